"""Low-rank adapters (LoRA) on a model's linear layers, trained under any parallelkit layout.

`add_adapters(model, LoRA(...))` turns each targeted `nn.Linear` into a `LoRALinear` in place: the same module
under the same name, its weight and bias untouched (and frozen), plus two trainable matrices, `lora_A` (rank x in)
and `lora_B` (out x rank), whose product, scaled by alpha / rank, is added to the layer's output. Every other
parameter of the model is frozen. Because the module keeps its name and stays an `nn.Linear`, the model's parallel
plan (tensor-parallel styles, FSDP units, pipeline layers) applies unchanged:

- under tensor parallelism the adapters follow their layer's split (`adapted_style`, which the layer hands the
  parallel code through its `adapt_tp_style`): for a column-wise layer A is whole and B column-wise, for a row-wise
  layer A row-wise and B whole, so the adapter adds no collective in forward (its partial sums join the layer's own
  reduction);
- under FSDP2 the adapters share their block's unit with the frozen weights; only they get gradients, so only
  they are reduce-scattered and only they have optimizer state;
- checkpoints of a parallelkit strategy hold the trainable parameters only (the base weights come from where they
  came from the first time: `pretrained`, or the seed);
- QLoRA (`quantize_base: "nf4"`): the adapted layers' frozen weights are stored as NF4 (`parallelkit.adapters.nf4`)
  once their values are known (at build, or read from `pretrained` by a strategy before FSDP shards them), and FSDP2
  shards and gathers them as 4-bit data; tensor parallelism cannot split them and is refused by the model's plan.

Why not `peft`: its `LoraLayer` wraps the target (`q_proj` becomes a wrapper holding `q_proj.base_layer`), so the
plan's globs would name a module torch's tensor-parallel styles cannot split, and its DTensor support is tied to
transformers' own tensor parallelism. The adapters' math and initialisation are PEFT's (A Kaiming-uniform, B zero,
scaling alpha / rank), so `parallelkit export-hf --adapters` writes a directory `peft.PeftModel.from_pretrained`
loads with the same outputs.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from parallelkit.adapters.experts import adapt_experts, expert_parameters, quantize_experts, unquantized_experts
from parallelkit.adapters.nf4 import EXPERTS_SUFFIX, is_nf4, nf4_available, release_freed_memory, to_nf4
from parallelkit.contract import EXPERTS_CONTRACT, declared_plan, matches, matches_suffix
from parallelkit.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

ALL_LINEAR = "all-linear"
"""`targets` value: every `nn.Linear` of the model except its output layer (the plan's `vocab_head`), as PEFT's."""

ADAPTER_PARAMETERS = ("lora_A", "lora_B")


@dataclass
class LoRA:
    """Which linear layers get adapters, and their shape.

    Args:
        rank: Inner dimension of the adapters (r).
        alpha: The adapter's output is scaled by alpha / rank.
        dropout: Dropout on the adapter's input (training only).
        targets: Module-name globs (`*` = one path segment) matched against the last segments of each module's name,
            so `q_proj` or `*.q_proj` finds every `...self_attn.q_proj`, `blocks.0.attn.q` only that one; or
            "all-linear": every `nn.Linear` but the output layer.
        quantize_base: "nf4": the targeted layers' frozen weights stored in 4 bits (QLoRA; `parallelkit.adapters.nf4`,
            needs torchao), the adapters in the training precision. None: the base stays as built.
        quantize_others: With `quantize_base`, every other linear layer but the output layer stored in 4 bits too
            (frozen, without adapters); embeddings, norms and the output layer stay in the training precision.
        init_from: A PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`: what
            `export-hf --adapters` and `PeftModel.save_pretrained` write) the adapters start from instead of A's draw
            and B's zeros, to continue it: the same targets, rank and alpha. `HFCausalLM` reads it.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] | str = field(default_factory=lambda: ALL_LINEAR)
    quantize_base: str | None = None
    quantize_others: bool = False
    init_from: str | None = None

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.rank, int) or self.rank < 1:
            problems.append(f"rank={self.rank!r} must be a positive integer (e.g. 8)")
        if not self.alpha > 0:
            problems.append(f"alpha={self.alpha!r} must be positive (e.g. 2 x rank)")
        if not 0 <= self.dropout < 1:
            problems.append(f"dropout={self.dropout!r} must be in [0, 1)")
        if isinstance(self.targets, str) and self.targets != ALL_LINEAR:
            self.targets = [self.targets]
        if isinstance(self.quantize_base, str) and self.quantize_base.lower() in ("", "none", "null"):
            self.quantize_base = None  # as a command-line override of one key of the mapping writes null
        if self.quantize_base not in (None, "nf4"):
            problems.append(f"quantize_base={self.quantize_base!r} must be 'nf4' (QLoRA) or null")
        if self.quantize_others and not self.quantize_base:
            problems.append("quantize_others=true stores the other linear layers as quantize_base says: set it (nf4)")
        if not self.targets:
            problems.append(f"targets is empty: name module globs (e.g. ['q_proj', 'v_proj']) or {ALL_LINEAR!r}")
        if problems:
            raise ConfigError(f"model.init_args.lora: {'; '.join(problems)}.")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def as_lora(value: LoRA | dict[str, Any] | None) -> LoRA | None:
    """A `LoRA` from what a model's `lora` argument may be given as (a mapping from YAML, or a LoRA)."""
    if value is None or isinstance(value, LoRA):
        return value
    unknown = set(value) - set(LoRA.__dataclass_fields__)
    if unknown:
        raise ConfigError(
            f"model.init_args.lora has unknown keys {sorted(unknown)}; it takes {', '.join(LoRA.__dataclass_fields__)}."
        )
    return LoRA(**value)


class LoRALinear(nn.Linear):
    """An `nn.Linear` plus a low-rank update: `linear(x) + B(A(dropout(x))) * scaling`, with A and B trainable
    parameters of the module itself (no child modules, so torch's tensor-parallel styles still see a plain linear
    layer; `adapted_style` places A and B). Made from an existing layer by `add_adapters`, never constructed."""

    rank: int
    scaling: float
    lora_dropout: float
    lora_seed: int
    lora_A: nn.Parameter
    lora_B: nn.Parameter

    def reset_parameters(self) -> None:
        if not is_nf4(self.weight):  # a quantized base is final: it was read or drawn before it was quantized
            super().reset_parameters()
        if hasattr(self, "lora_A"):  # nn.Linear's constructor calls this before adapters exist
            self.reset_adapters()

    @torch.no_grad()
    def reset_adapters(self) -> None:
        """A as `nn.Linear` initialises a weight (Kaiming-uniform), B zero: the adapted layer starts as the base.

        A is drawn from a generator seeded by the run's seed and the module's name, not from torch's global one:
        the same values whatever the layout, the build (eager or meta) and the order modules are initialised in, and
        the global generator (data order, dropout) advances exactly as without adapters."""
        generator = torch.Generator().manual_seed(self.lora_seed)
        bound = 1 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear and PEFT
        nn.init.uniform_(self.lora_A, -bound, bound, generator=generator)
        nn.init.zeros_(self.lora_B)

    lora_disabled = False  # `adapters_disabled`: the base layer alone (DPO's reference, as PEFT's disable_adapter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.lora_disabled:
            return out
        if self.lora_dropout:
            x = F.dropout(x, self.lora_dropout, self.training)
        return out + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"

    def adapt_tp_style(self, style: ParallelStyle) -> ParallelStyle:
        """The tensor-parallel style of this layer, adapters included (`parallelkit.contract.TP_STYLE_HOOK`)."""
        return adapted_style(style)


def _adapt(module: nn.Linear, lora: LoRA, seed: int) -> LoRALinear:
    """Turn `module` into a LoRALinear in place: the same object, so its name, weight and hooks stay."""
    weight = module.weight
    module.__class__ = LoRALinear
    module.rank, module.scaling, module.lora_dropout, module.lora_seed = lora.rank, lora.scaling, lora.dropout, seed
    module.quantize_base = lora.quantize_base
    module.lora_A = nn.Parameter(torch.empty(lora.rank, module.in_features, device=weight.device, dtype=weight.dtype))
    module.lora_B = nn.Parameter(torch.empty(module.out_features, lora.rank, device=weight.device, dtype=weight.dtype))
    if not module.lora_A.is_meta:  # on the meta device, materialisation calls reset_parameters()
        module.reset_adapters()
    return module


def output_layers(model: nn.Module) -> set[str]:
    """Names of the modules the model's declared plan calls its output layer (style `vocab_head`)."""
    heads = [pattern for pattern, style in declared_plan(model).tp.items() if style == "vocab_head"]
    return {name for name, _ in model.named_modules() if any(matches(p, name) for p in heads)}


def add_adapters(model: nn.Module, lora: LoRA | dict[str, Any] | None) -> list[str]:
    """Give `lora.targets`' linear layers adapters and freeze every other parameter of `model`.

    Call it where the model builds its layers (on the meta device too), before a strategy applies its plan: for a
    LightningModule of your own, at the end of its `__init__` (`GPT` and `HFCausalLM` do it for their `lora`
    argument). Each targeted layer becomes a `LoRALinear` in place, under the same name, so the model's parallel plan
    applies unchanged.

    ```python
    class MyModel(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = MyNetwork()
            add_adapters(self, {"rank": 8, "alpha": 16, "targets": ["attn.q", "attn.v"]})
    ```

    Args:
        model: The module whose linear layers get adapters: a LightningModule, or a network inside one.
        lora: A `LoRA`, or the mapping of its fields as a config writes it; None adds nothing (the model trains
            whole).

    Returns:
        The adapted modules' names, in module order.

    Raises:
        ConfigError: A target that matches no module, or matches a module that is not a `torch.nn.Linear`; a model
            that has adapters already.
    """
    lora = as_lora(lora)
    if lora is None:
        return []
    named = [(name, m) for name, m in model.named_modules() if name]
    stacked = expert_parameters(model)
    experts: dict[str, list[str]] = {}  # experts module -> its targeted parameters, in target order (PEFT's nesting)
    if lora.targets == ALL_LINEAR:
        skip = output_layers(model)
        chosen = [(n, m) for n, m in named if isinstance(m, nn.Linear) and n not in skip]
    else:
        picked: set[str] = set()
        for pattern in lora.targets:
            found = [n for n, _ in named if matches_suffix(pattern, n)]
            parameters = [n for n in stacked if matches_suffix(pattern, n)]
            if not found and not parameters:
                other = next((n for n, p in model.named_parameters() if matches_suffix(pattern, n)), None)
                if other is not None:  # a parameter, but not one an adapter can go on
                    owner = model.get_submodule(other.rpartition(".")[0]) if "." in other else model
                    raise ConfigError(
                        f"lora.targets entry {pattern!r} names {other} {list(model.get_parameter(other).shape)} of "
                        f"{type(owner).__name__}, which is not an experts parameter: adapters go on torch.nn.Linear "
                        f"layers and on the stacked parameters of an experts module ({EXPERTS_CONTRACT.split(':')[0]}: "
                        "a num_experts attribute equal to their first dimension). Fix: target that module's linear "
                        "layers, or give the module num_experts and its parameters the experts' first dimension."
                    )
                linear = [n for n, m in named if isinstance(m, nn.Linear)]
                leaves = sorted({n.rpartition(".")[2] for n in linear})
                raise ConfigError(
                    f"lora.targets entry {pattern!r} matches no module of {type(model).__name__}. Targets match the "
                    f"last segments of module names; its linear layers end in: {', '.join(leaves)} (e.g. "
                    f"{linear[0] if linear else 'none'}). Or targets: {ALL_LINEAR}."
                    + (f" Experts' parameters can be targets too: e.g. {next(iter(stacked))}." if stacked else "")
                )
            picked.update(found)
            for name in parameters:
                owner, _, attr = name.rpartition(".")
                if attr not in experts.setdefault(owner, []):
                    experts[owner].append(attr)
        chosen = [(n, m) for n, m in named if n in picked]  # in module order
    if not chosen and not experts:
        raise ConfigError(f"lora.targets={lora.targets!r} finds no linear layer in {type(model).__name__}.")
    held = dict(named)
    for name, module in chosen:
        if isinstance(module, LoRALinear):
            raise ConfigError(f"{name} has adapters already: add_adapters is called once per model.")
        if type(module) is not nn.Linear:
            own = [n for n in stacked if n.rpartition(".")[0] == name]
            raise ConfigError(
                f"lora.targets matches {name} ({type(module).__name__}): adapters go on torch.nn.Linear layers and "
                "on experts' stacked parameters only. Fix: narrow the targets to linear layers (e.g. ['q_proj', "
                f"'v_proj']){' or name its experts parameters (' + ', '.join(own) + ')' if own else ''}."
            )
    for param in model.parameters():
        param.requires_grad_(False)
    seed = torch.initial_seed()
    for name, module in chosen:
        if type(module) is nn.Linear:
            _adapt(module, lora, seed=_adapter_seed(seed, name))
    for owner, attrs in experts.items():
        if lora.dropout:
            raise ConfigError(
                f"lora.targets adapts {owner}'s experts ({', '.join(attrs)}) with lora.dropout={lora.dropout:g}: "
                "adapters on experts' parameters take no dropout (as PEFT's parameter adapters). Fix: lora.dropout: "
                "0, or adapt the dense layers only."
            )
        seeds = [_adapter_seed(seed, f"{owner}.{attr}") for attr in attrs]
        adapt_experts(held[owner], attrs, lora.rank, lora.scaling, seeds, lora.quantize_base)
    if lora.quantize_base:
        nf4_available()  # asking for NF4 without torchao: one clear error, at build time
        if lora.quantize_others:
            skip, adapted = output_layers(model), {name for name, _ in chosen}
            for name, module in named:
                if type(module) is nn.Linear and name not in skip and name not in adapted:
                    module.quantize_base = lora.quantize_base
        quantize_base(model)  # weights built with values now; meta ones when their values are known
    return [name for name, module in chosen if isinstance(module, LoRALinear)] + [
        f"{owner}.{attr}" for owner, attrs in experts.items() for attr in attrs
    ]


def _adapter_seed(seed: int, name: str) -> int:
    """The seed of the adapters on `name` (a module or an experts parameter): the run's and the name's, so their
    draw is the same in every layout and build."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


QUANTIZED_TP_REFUSAL = (
    "lora.quantize_base: nf4 stores the base weights as torchao NF4Tensors, which torch's tensor-parallel styles "
    "cannot split (a weight's 4-bit codes and its block scales would have to be cut together, column- or row-wise). "
    'Fix: a layout without tp (fsdp, hsdp, pipelines: e.g. mesh_shape [[-1], ["fsdp"]]), or quantize_base: null.'
)
"""The refusal a QLoRA model's plan gives tensor parallelism."""


def adapter_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def quantize_base(
    model: nn.Module,
    read: Callable[[str], torch.Tensor | None] | None = None,
    device: torch.device | None = None,
    prefix: str = "",
) -> list[str]:
    """Store the frozen weight of every layer that asks for it (`LoRA.quantize_base`: adapted layers, and with
    `quantize_others` the other linear layers) as NF4, once: a weight
    with values as it is; a weight still on the meta device from `read(name)` (its full-precision values, e.g. from
    the pretrained files; quantized on `device`, default where they are; `prefix` makes `model`'s names the ones
    `read` knows), left as it is when `read` has none. Adapted experts parameters too, expert by expert
    (`parallelkit.adapters.experts.quantize_experts`; `read(name, rows)` gives this rank's experts). Returns the names
    of the weights quantized now."""
    done = []
    for name, module in model.named_modules():
        if getattr(module, "expert_adapters", None):
            done += quantize_experts(module, read, device, f"{prefix}{name}." if name else prefix)
    for name, module in model.named_modules():
        if not wants_nf4(module) or is_nf4(module.weight):
            continue
        weight = module.weight
        if weight.is_meta:
            values = read(f"{prefix}{name}.weight") if read is not None else None
            if values is None:
                continue
        else:
            values = weight.detach()
        values = values.to(device=device or values.device, dtype=weight.dtype)
        module.weight = nn.Parameter(to_nf4(values, f"{name}.weight"), requires_grad=False)
        del values
        release_freed_memory()
        done.append(f"{name}.weight")
    return done


def wants_nf4(module: nn.Module) -> bool:
    """Whether `module` is a linear layer whose (frozen) weight is to be stored as NF4."""
    return getattr(module, "quantize_base", None) == "nf4"


def quantized_names(model: nn.Module) -> list[str]:
    """The parameters of `model` stored as NF4 (an experts parameter's by its stored name, `..._nf4`)."""
    return [name for name, param in model.named_parameters() if is_nf4(param) or name.endswith(EXPERTS_SUFFIX)]


def unquantized(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The weights of `model` that ask for NF4 and are not stored in it yet (by name), as they are now."""
    dense = [
        (f"{name}.weight", m.weight)
        for name, m in model.named_modules()
        if wants_nf4(m) and (m.weight.is_meta or not is_nf4(m.weight))
    ]
    return dense + unquantized_experts(model)


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) or getattr(m, "expert_adapters", None) for m in model.modules())


def is_adapter(name: str) -> bool:
    """Whether the parameter name is an adapter's (`...q_proj.lora_A`, `...experts.gate_up_proj_lora_A`)."""
    return name.rpartition(".")[2].endswith(ADAPTER_PARAMETERS)  # the experts' end with them too


def reset_adapters(model: nn.Module) -> None:
    """Initialise every adapter of `model` (after a strategy materialised it, or after base weights were loaded)."""
    for _, module in adapter_modules(model):
        module.reset_adapters()
    for module in model.modules():
        for adapter in getattr(module, "expert_adapters", {}).values():
            adapter.reset(module)


def trainable_names(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


WHOLE_UNDER = {"colwise": "lora_A", "colwise_gather": "lora_A", "vocab_head": "lora_A", "rowwise": "lora_B"}
"""tp style name of a layer -> its adapter that tensor parallelism keeps whole (the other is split with the layer),
as `adapted_style` places them; the planner counts by it."""


def adapted_style(style: ParallelStyle) -> ParallelStyle:
    """`style` (torch's, for a `LoRALinear`) with the adapters following the layer's split: for a column-wise layer
    A is replicated and B split on its output rows; for a row-wise one A is split on its input columns and B
    replicated. Anything else keeps both adapters replicated over the tp group."""
    if isinstance(style, ColwiseParallel):
        placements = (Replicate(), Shard(0))
    elif isinstance(style, RowwiseParallel):
        placements = (Shard(1), Replicate())
    else:
        placements = (Replicate(), Replicate())
    return _AdaptedStyle(style, placements)


class _AdaptedStyle(ParallelStyle):
    """The layer's own style applied to its weight and bias, then each adapter placed as `placements` say."""

    def __init__(self, base: ParallelStyle, placements: tuple[Placement, Placement]) -> None:
        super().__init__()
        self.base, self.placements = base, placements

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # Out of the module while torch's style splits it: its partition functions shard every parameter alike.
        held = {name: getattr(module, name) for name in ADAPTER_PARAMETERS}
        for name in held:
            delattr(module, name)
        parallelize_module(module, device_mesh, self.base)
        for (name, param), placement in zip(held.items(), self.placements):
            dist = distribute_tensor(param.detach(), device_mesh, [placement])
            module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))
        return module

    def __repr__(self) -> str:
        return f"AdaptedStyle({self.base!r}, A={self.placements[0]}, B={self.placements[1]})"


def config_dict(lora: LoRA | None) -> dict[str, Any] | None:
    """`lora` as plain values (what a checkpoint's hyperparameters hold: loadable with `weights_only=True`)."""
    return None if lora is None else asdict(lora)
