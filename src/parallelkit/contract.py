"""The model contract as one object: what a model tells parallelkit about how it may be parallelised.

Strategies, the planner and the monitors read a `ParallelPlan` and nothing else of the model's; none of them
names a model class or a model's attributes. A model provides its plan in one of two ways:

- a `parallel_plan()` method returning a `ParallelPlan` (`parallelkit.models.HFCausalLM` reads a Hugging Face
  model's own plans this way);
- the class attributes of the model contract (the README's "The model contract": `tp_plan`, `fsdp_units`,
  `pipeline_layers`, and the methods `pipeline_loss(output, target)` and `flops_per_token(seq_len)`), which
  `ParallelPlan.from_attributes` reads. The reference GPT and most user models do this.

This module is a leaf: it imports nothing of parallelkit's, so a model, LoRA and the parallel code can all read it.
Turning a plan into module names for one model and layout is `parallelkit.parallel.resolve`'s job
(docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

STYLES = (
    "gather_input",
    "gather_sequence",
    "colwise",
    "rowwise",
    "rowwise_split_input",
    "colwise_gather",
    "sequence_parallel",
    "shard_sequence",
    "vocab_embedding",
    "vocab_embedding_whole",
    "vocab_head",
    "head_norm",
    "replicate",
)
"""Style names a `tp_plan` may use; what each becomes depends on sequence/loss parallelism
(`parallelkit.parallel.tensor_parallel.tp_style`)."""

SHARDING_STYLES = (
    "colwise",
    "rowwise",
    "rowwise_split_input",
    "colwise_gather",
    "vocab_embedding",
    "vocab_embedding_whole",
    "vocab_head",
)
"""Styles that split a module's weights over the tp group (each rank holds 1 / tp of them)."""

GATHERING_STYLES = ("gather_input", "colwise", "colwise_gather", "vocab_head")
"""Styles whose input sequence parallelism all-gathers (and autograd then keeps whole); the other sharding styles
reduce-scatter (or all-reduce) their output. A column-wise layer inside a `gather_input` module takes the input
that module gathered: one all-gather serves them all."""

TP_STYLE_HOOK = "adapt_tp_style"
"""A module with a method of this name, `adapt_tp_style(style) -> style`, changes the torch `ParallelStyle` the plan
gives it (a `LoRALinear` splits its adapters as its layer): the parallel code calls it and knows no module class."""


EXPERT_WEIGHTS_HOOK = "adapted_weights"
"""An experts module with a method of this name, `adapted_weights() -> context manager`, computes with other values
of its parameters than the ones it holds while the context lasts (LoRA adapters on its experts: `W + B @ A`); expert
parallelism enters it around the module's own forward, once its parameters are this rank's: it knows no adapter."""

EXPERTS_CONTRACT = """an experts module holds every expert of one mixture-of-experts layer: an int attribute
`num_experts`, every parameter with the expert index as its first dimension (e.g. gate_up_proj [E, 2I, H], down_proj
[E, H, I]), and `forward(tokens [N, H], top_k_index [N, k], top_k_weights [N, k]) -> [N, H]` giving each token the sum
of its chosen experts' outputs weighted by its router's weights (the router runs outside it, in the MoE block).
transformers' MoE families (Qwen3-MoE, Mixtral, OLMoE, ...) follow it; so does parallelkit's GPT with `n_expert`."""
"""What a module named in `ParallelPlan.experts` must be: expert parallelism replaces its forward by one that sends
each token to the rank holding its expert and calls the module's own forward there on the experts that rank holds."""

ATTENTION_CONTRACT = """an attention module computes its attention in a method `attend(q, k, v, positions) -> out`:
q (batch, heads, seq, head_dim), k and v (batch, kv_heads, seq, head_dim) after the rotary embedding, `positions`
(batch, seq) the tokens' positions (restarting at 0 where a packed example begins) or None for one causal row; out
(batch, heads, seq, head_dim) is causal attention within each example. parallelkit's GPT follows it."""
"""What a module named in `ParallelPlan.attention` must be: context parallelism, which gives each rank a slice of
every sequence, replaces its `attend` by one that attends across the slices (`parallel/context_parallel.py`). The
replacement also takes `scale`, `window` (a sliding window) and `softcap` as keywords, as transformers' attention
functions pass them."""

ATTENTION_HOOK = "route_attention"
"""A model with a method of this name, `route_attention()`, does not compute attention in its modules' own `attend`
methods but routes it to the `attend` that context parallelism gives each module named in `ParallelPlan.attention`,
once called (`HFCausalLM` switches transformers' attention function to one that calls it): its attention modules
need no `attend` of their own."""


def matches(pattern: str, fqn: str) -> bool:
    """True when `fqn` matches `pattern` segment by segment (`*`, and any fnmatch pattern, never crosses a dot)."""
    parts, names = pattern.split("."), fqn.split(".")
    return len(parts) == len(names) and all(fnmatchcase(n, p) for p, n in zip(parts, names))


def matches_suffix(pattern: str, name: str) -> bool:
    """True when `pattern`'s segments match the last segments of the module or parameter name `name` (`*`: one
    segment)."""
    parts = pattern.split(".")
    names = name.split(".")
    return len(names) >= len(parts) and matches(pattern, ".".join(names[len(names) - len(parts) :]))


HEAD_COUNT_ATTRS = ("n_head", "num_heads")
"""Attributes by which a module written to the attribute contract states its head count (tp must divide it)."""


IGNORE_INDEX = -100
"""A target that is not one: the position is left out of the loss and of the target count (cross-entropy's default
`ignore_index`, and transformers' label convention)."""

TOKEN_BATCH = ("input_ids", "labels", "position_ids", "num_targets")
"""The keys of a token batch, the other batch convention (`parallelkit.data.SFTDataModule` yields it): `input_ids`
and `labels` (B, S), `labels` being each position's next token or `IGNORE_INDEX`; `position_ids` (B, S), which
restart at 0 where a packed example begins (a token attends only to earlier tokens of its own example); and
`num_targets`, the number of targets in the whole optimizer step (every data-parallel rank's batch, every accumulated
micro-batch), by which the step's loss is divided: a token mean over the global batch, whatever the layout."""

REPLICA_TARGETS = "replica_targets"
"""An optional key of a token batch, which replica groups need: the target count of its optimizer step per
data-parallel replica of the whole job (every group's ranks, group g's after those of groups 0..g-1), shape
(replicas,). A group sums its own; the step's quorum sums the groups taking part, which is the step's `num_targets`."""


PREFERENCE_BATCH = ("input_ids", "labels", "position_ids", "pair_index", "chosen_targets")
"""The keys of a preference batch (`parallelkit.data.PreferenceDataModule` yields it): B pairs as 2B rows, the chosen
sequences first, then the rejected ones in the same order. `input_ids`, `labels` (the next token where it is a
completion token, else `IGNORE_INDEX`) and `position_ids` are (2B, S); `pair_index` (B,) the pairs' indices in their
split; `chosen_targets` the chosen completion tokens of the global micro-batch (every data-parallel rank's pairs)."""


FROZEN_REFERENCE = "frozen_reference"
"""The hook a strategy reads for preference tuning's frozen reference (`model.frozen_reference()`): an `nn.Module`
whose module names are the model's, which the strategy parallelises as the model and fills with the model's values,
never trained; None when the model wants no copy."""


def is_preference_batch(batch: Any) -> bool:
    """Whether `batch` is a preference batch (`PREFERENCE_BATCH`)."""
    return isinstance(batch, Mapping) and "pair_index" in batch


def packed_examples(positions: torch.Tensor) -> torch.Tensor:
    """Each token's example within its packed row, (batch, seq): a new one wherever a position does not follow the
    one before it (as transformers reads packed `position_ids`). A token attends only to earlier tokens of its own."""
    starts = torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1) != 1
    return starts.cumsum(-1)


def token_share(loss: torch.Tensor, targets: torch.Tensor, step_targets: torch.Tensor) -> torch.Tensor:
    """A batch's share of its optimizer step's token-mean loss: its `loss` (the mean over its own targets) times its
    target count, over the step's (`num_targets`). Summed over every data-parallel rank and accumulated micro-batch of
    the step, the shares are the mean over every target of the global batch; a batch with no target adds 0."""
    count = targets.ne(IGNORE_INDEX).sum()
    return torch.where(count > 0, loss * count, 0.0) / step_targets.clamp(min=1)


def split_pair(batch: Any) -> tuple[Any, Any]:
    """The default batch convention: `(inputs, target)`; a batch of inputs alone (a tensor, or a 1-tuple as a
    `TensorDataset` of inputs gives) has no target, as in `predict`. A token batch (`TOKEN_BATCH`) gives its
    `input_ids` and `labels`."""
    if isinstance(batch, Mapping):
        return batch["input_ids"], batch.get("labels")
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    return (batch[0] if isinstance(batch, (tuple, list)) and len(batch) == 1 else batch), None


@dataclass(frozen=True)
class ParallelPlan:
    """How a model is split. Module names are FQNs relative to the LightningModule, with `*` for one path segment.

    Attributes:
        tp: Module glob -> tensor-parallel style: a name from `STYLES` or a torch `ParallelStyle`.
        fsdp_units: Module globs sharded as their own FSDP groups. None: each child of the largest `nn.ModuleList`.
        pipeline_layers: Module globs in execution order; a pipeline stage runs a contiguous run of them.
        pipeline_refusal: Why this model cannot be pipelined, as the error a pipeline strategy raises (empty: it can).
        tp_refusal: Why this model cannot be tensor-parallel, as the error a tp > 1 layout raises (empty: it can).
        experts: Globs of the mixture-of-experts layers' experts modules, which expert parallelism divides over the
            `ep` axis (each rank holds `num_experts / ep` whole experts). Such a module follows `EXPERTS_CONTRACT`.
        experts_refusal: Why this model's experts cannot be divided (the error an `ep` layout raises; empty: they can).
        attention: Globs of the attention modules, which context parallelism makes attend across the `cp` axis's
            slices of the sequence. Such a module follows `ATTENTION_CONTRACT` (or the model `ATTENTION_HOOK`).
        attention_refusal: Why this model's sequences cannot be split over cp ranks (the error a cp > 1 layout raises;
            empty: they can).
        tp_divisors: Counts that the tp degree must divide, by what they count (e.g. {"key/value heads": 2}):
            whole heads per rank. Sizes of split weights are checked from the modules themselves.
        loss: `loss(output, target)`: the mean loss of a batch from the model's output (the last pipeline stage
            calls it). Must be `F.cross_entropy` based for loss parallelism.
        auxiliary_loss: `auxiliary_loss()`: what the last pipeline stage adds to each microbatch's training loss,
            from its forward (an MoE model's routers' load-balancing loss); None: nothing.
        split_batch: A batch as `(inputs, target)`: inputs feed the first pipeline stage, target the loss (None
            for a batch of inputs alone, as `predict` gets).
        stage_forward: How a pipeline stage runs its layers: `stage_forward(layers, *args)`, with `layers` the
            stage's `(name, module)` in order and `args` what the previous stage returned (the first stage gets the
            inputs). May return a tuple: the next stage receives it as its arguments. None: each layer is called on
            the previous one's output (one tensor in, one out).
        stage_modules: Modules every pipeline stage needs besides its layers (e.g. a rotary-embedding table that
            each stage recomputes positions with). They must hold no parameters.
        flops_per_token: `flops_per_token(seq_len)`: training FLOPs per token of the whole model.
        description: What the plan came from, for error messages (e.g. "HFCausalLM (llama)").
    """

    tp: Mapping[str, Any] = field(default_factory=dict)
    fsdp_units: Sequence[str] | None = None
    pipeline_layers: Sequence[str] | None = None
    pipeline_refusal: str = ""
    tp_refusal: str = ""
    experts: Sequence[str] = ()
    experts_refusal: str = ""
    attention: Sequence[str] = ()
    attention_refusal: str = ""
    tp_divisors: Mapping[str, int] = field(default_factory=dict)
    loss: Callable[[Any, Any], Any] | None = None
    auxiliary_loss: Callable[[], Any] | None = None
    split_batch: Callable[[Any], tuple[Any, Any]] = split_pair
    stage_forward: Callable[..., Any] | None = None
    stage_modules: Sequence[str] = ()
    flops_per_token: Callable[[int], float] | None = None
    description: str = ""

    @classmethod
    def from_attributes(cls, model: nn.Module) -> ParallelPlan:
        """The plan a model declares through the model contract's class attributes and methods (README)."""
        loss = getattr(model, "pipeline_loss", None)
        flops = getattr(model, "flops_per_token", None)
        return cls(
            tp=dict(getattr(model, "tp_plan", None) or {}),
            fsdp_units=getattr(model, "fsdp_units", None),
            pipeline_layers=getattr(model, "pipeline_layers", None),
            experts=tuple(getattr(model, "experts_plan", None) or ()),
            attention=tuple(getattr(model, "attention_plan", None) or ()),
            tp_divisors=_declared_head_counts(model, getattr(model, "tp_plan", None) or {}),
            loss=loss if callable(loss) else None,
            flops_per_token=flops if callable(flops) else None,
            description=type(model).__name__,
        )


def declared_plan(model: nn.Module) -> ParallelPlan:
    """What `model` declares: its `parallel_plan()` method's plan if it has one, else its class attributes'.

    Read once per layout, by `parallelkit.parallel.resolve` (and by `add_adapters` at build time, for the output
    layer `all-linear` leaves out); everything else reads the resolved plan."""
    provider = getattr(model, "parallel_plan", None)
    plan = provider() if callable(provider) else ParallelPlan.from_attributes(model)
    return plan if plan.description else replace(plan, description=type(model).__name__)


def _declared_head_counts(model: nn.Module, tp: Mapping[str, Any]) -> dict[str, int]:
    """Head counts stated as `n_head`/`num_heads` by modules that the tp plan splits inside."""
    split_modules = [fqn for fqn, _ in model.named_modules() if any(matches(p, fqn) for p in tp)]
    counts = {}
    for fqn, module in model.named_modules():
        heads = next((getattr(module, a) for a in HEAD_COUNT_ATTRS if isinstance(getattr(module, a, None), int)), None)
        split = any(name.startswith(f"{fqn}.") for name in split_modules)
        if heads is not None and fqn and split:
            counts[f"attention heads ({fqn})"] = heads
    return counts


def shards_the_sequence(plan: ParallelPlan) -> bool:
    """Whether `plan` shards a stream on the sequence dim under sequence parallelism: it names norms (or any module)
    `sequence_parallel`, or gives a torch `SequenceParallel` style. Without one, column- and row-wise layers alone
    see activations whose dim 1 need not be a sequence (batch x features)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    return any(style == "sequence_parallel" or isinstance(style, SequenceParallel) for style in plan.tp.values())
