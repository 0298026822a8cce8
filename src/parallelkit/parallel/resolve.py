"""A model's declared `ParallelPlan` resolved for one layout: module names expanded, sizes checked, stages split.

`resolve` is where a plan is read and turned into names, once per process and layout: the strategy calls it before
launch (so a layout that cannot work is refused before any worker starts) and once in `setup`; `parallelize`, the
planner, the monitors and the pipeline schedule read the `ResolvedPlan` it returns (docs/architecture.md).

Patterns are module FQNs where `*` (and any fnmatch pattern) stands for exactly one path segment.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from parallelkit.contract import (
    ATTENTION_CONTRACT,
    ATTENTION_HOOK,
    EXPERTS_CONTRACT,
    GATHERING_STYLES,
    HEAD_COUNT_ATTRS,
    STYLES,
    ParallelPlan,
    declared_plan,
    matches,
    shards_the_sequence,
)
from parallelkit.errors import PlanError


@dataclass(frozen=True)
class ResolvedPlan:
    """The plan of one model for one layout.

    Attributes:
        plan: What the model declared.
        tp_size: The tensor-parallel degree it was checked against (1: no tp).
        sequence_parallel: Whether the tp styles shard the residual stream on the sequence dim.
        loss_parallel: Whether the loss takes vocab-sharded logits.
        tp_styles: Module name -> its declared style (a `STYLES` name or a torch `ParallelStyle`); empty when tp is 1.
        gathered: Column-wise module name -> the `gather_input` module whose gathered input it takes.
        ep_size: The expert-parallel degree it was checked against (1: every rank holds every expert).
        experts: Names of the experts modules (`ParallelPlan.experts`), whether divided (ep > 1) or not.
        fsdp_units: Names of the modules sharded as their own FSDP groups, in module order.
        pipeline_layers: The pipeline layers in execution order; empty when the model cannot be pipelined.
        pipeline_error: Why it cannot (the error a pipeline layout raises), or "".
        stages: For a pipeline layout, the layer names of every stage, in order.
        cp_size: The context-parallel degree (1: every rank holds whole sequences).
        cp_method: How attention crosses the cp ranks' slices (`parallelkit.parallel.context_parallel.METHODS`).
        attention: Names of the attention modules (`ParallelPlan.attention`), checked when cp > 1.
    """

    plan: ParallelPlan
    tp_size: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False
    tp_styles: Mapping[str, Any] = field(default_factory=dict)
    gathered: Mapping[str, str] = field(default_factory=dict)
    ep_size: int = 1
    experts: Sequence[str] = ()
    fsdp_units: Sequence[str] = ()
    pipeline_layers: Sequence[str] = ()
    pipeline_error: str = ""
    stages: Sequence[Sequence[str]] | None = None
    cp_size: int = 1
    cp_method: str = "allgather"
    attention: Sequence[str] = ()

    @property
    def description(self) -> str:
        return self.plan.description


def resolve(
    model: nn.Module,
    *,
    tp: int = 1,
    sequence_parallel: bool | None = None,
    loss_parallel: bool = False,
    ep: int = 1,
    num_stages: int | None = None,
    split_points: Sequence[int | str] | None = None,
    plan: ParallelPlan | None = None,
    cp: int = 1,
    cp_method: str = "allgather",
) -> ResolvedPlan:
    """Resolve `model`'s plan (`plan`, default what it declares) for a tp degree, an expert-parallel degree and, for
    pipelines, a number of stages; raises `PlanError` for what that layout cannot do, naming the fix.

    `sequence_parallel` None: on when tp > 1 and the plan shards norms on the sequence (a plan of column- and row-wise
    layers alone, e.g. on batch x features activations, has no sequence to shard).
    """
    plan = plan if plan is not None else declared_plan(model)
    shards = shards_the_sequence(plan)
    if sequence_parallel is None:
        sequence_parallel = tp > 1 and shards
    elif sequence_parallel and tp > 1 and not shards:
        raise PlanError(
            f"sequence_parallel=True, but {type(model).__name__}'s tp_plan shards nothing on the sequence dim "
            "(no 'sequence_parallel' entry: norms on the residual stream), so there is no sequence-sharded "
            "stream for its column- and row-wise layers to take and give back. Fix: sequence_parallel: false "
            "(or leave it out), or add its norms to tp_plan as 'sequence_parallel'."
        )
    styles: dict[str, Any] = {}
    if tp > 1:
        if plan.tp_refusal:
            raise PlanError(f"{plan.description}: {plan.tp_refusal}")
        styles = expand_tp(model, plan, tp)
    try:
        layers, pipeline_error = pipeline_layer_names(model, plan), ""
    except PlanError as err:
        layers, pipeline_error = [], str(err)
    stages = None
    if num_stages is not None:
        if pipeline_error:
            raise PlanError(pipeline_error)
        stages = split_stages(model, layers, num_stages, split_points)
    return ResolvedPlan(
        plan=plan,
        tp_size=tp,
        sequence_parallel=bool(sequence_parallel and tp > 1),
        loss_parallel=loss_parallel,
        tp_styles=styles,
        gathered=gathered_inside(styles),
        ep_size=ep,
        experts=expert_names(model, plan, ep),
        fsdp_units=fsdp_unit_names(model, plan),
        pipeline_layers=layers,
        pipeline_error=pipeline_error,
        stages=stages,
        cp_size=cp,
        cp_method=cp_method,
        attention=attention_names(model, plan, cp, cp_method, tp),
    )


def attention_names(model: nn.Module, plan: ParallelPlan, cp: int, method: str, tp: int) -> list[str]:
    """The plan's attention globs as module names; for cp > 1, each checked against `ATTENTION_CONTRACT`, and its
    heads per tp rank against cp for Ulysses, which divides them over the cp ranks."""
    from parallelkit.parallel.context_parallel import METHODS, check_heads

    if cp > 1 and method not in METHODS:
        raise PlanError(f"cp_method={method!r} is not a context-parallel method. Fix: one of {', '.join(METHODS)}.")
    if cp > 1 and plan.attention_refusal:
        raise PlanError(f"{plan.description}: {plan.attention_refusal}")
    if cp > 1 and not plan.attention:
        raise PlanError(
            f"mesh_shape has cp={cp}, but {plan.description} declares no attention modules (ParallelPlan.attention, or "
            "the class attribute attention_plan): context parallelism gives each rank a slice of every sequence, and "
            "only an attention module that attends across the slices keeps it exact. Fix: name the attention "
            f"modules, each computing its attention in attend(q, k, v, positions) ({ATTENTION_CONTRACT.split(':')[0]}"
            "), or a mesh without cp."
        )
    named = select(model, plan.attention, "attention_plan") if plan.attention else []
    routed = callable(getattr(model, ATTENTION_HOOK, None))  # the model calls the attend cp gives each module
    for fqn, module in named if cp > 1 else ():
        if not routed and not callable(getattr(module, "attend", None)):
            raise PlanError(
                f"{plan.description}.{fqn} ({type(module).__name__}) is declared an attention module but has no "
                f"attend(q, k, v, positions) method: {ATTENTION_CONTRACT}"
            )
        config = getattr(module, "config", None)  # transformers' attention modules count heads in their config
        heads = next((getattr(module, a) for a in HEAD_COUNT_ATTRS if isinstance(getattr(module, a, None), int)), None)
        heads = heads or getattr(config, "num_attention_heads", None)
        if method == "ulysses" and isinstance(heads, int):
            kv_heads = getattr(module, "num_key_value_heads", None) or getattr(config, "num_key_value_heads", None)
            check_heads(heads // tp, (kv_heads or heads) // tp, cp)
    return [fqn for fqn, _ in named]


def select(model: nn.Module, patterns: Iterable[str], field: str) -> list[tuple[str, nn.Module]]:
    """Modules whose FQN matches one of `patterns`, in module order; a pattern matching nothing is an error."""
    patterns = list(patterns)
    named = [(fqn, module) for fqn, module in model.named_modules() if fqn]
    for pattern in patterns:
        if not any(matches(pattern, fqn) for fqn, _ in named):
            top = ", ".join(fqn for fqn, _ in named if "." not in fqn)
            raise PlanError(
                f"{type(model).__name__}.{field} entry {pattern!r} matches no module. Patterns are module "
                f"names with '*' for one path segment (e.g. 'blocks.*.attn.q'); the top-level modules are: "
                f"{top}."
            )
    return [(fqn, module) for fqn, module in named if any(matches(p, fqn) for p in patterns)]


def expand_tp(model: nn.Module, plan: ParallelPlan, tp: int | None = None) -> dict[str, Any]:
    """The plan's tp globs as {module name: declared style}; with `tp`, checked against it (split sizes, heads)."""
    if not plan.tp:
        raise PlanError(
            f"tensor parallelism (tp={tp}) needs {plan.description}.tp_plan: a dict from module name "
            "globs to styles, e.g. {'blocks.*.attn.q': 'colwise', 'blocks.*.attn.proj': 'rowwise'}. "
            f"Styles: {', '.join(STYLES)}. Or use a mesh without a tp axis."
        )
    styles: dict[str, Any] = {}
    for pattern, style in plan.tp.items():
        for fqn, module in select(model, [pattern], "tp_plan"):
            if tp is not None and isinstance(style, str):
                _check_divisible(model, fqn, module, style, tp)
            styles[fqn] = style
    if tp is not None:
        _check_divisors(plan, tp)  # after the sizes of split weights, which name the module
    return styles


def expert_names(model: nn.Module, plan: ParallelPlan, ep: int = 1) -> list[str]:
    """The plan's experts globs as module names; for ep > 1, each checked against `EXPERTS_CONTRACT` and `ep`."""
    if ep > 1 and plan.experts_refusal:
        raise PlanError(f"{plan.description}: {plan.experts_refusal}")
    if ep > 1 and not plan.experts:
        raise PlanError(
            f"mesh_shape has ep={ep}, but {plan.description} declares no experts modules (ParallelPlan.experts, or "
            "the class attribute experts_plan): expert parallelism divides the experts of mixture-of-experts layers "
            "over the ep axis, and a dense model has none. Fix: use fsdp for the data-parallel ranks (e.g. mesh_shape "
            '[[-1], ["fsdp"]]), or declare the experts modules if the model has some.'
        )
    named = select(model, plan.experts, "experts_plan") if plan.experts else []
    for fqn, module in named if ep > 1 else ():  # unchecked when nothing divides them: they run as written
        count = getattr(module, "num_experts", None)
        params = list(module.named_parameters())
        wrong = [(name, tuple(p.shape)) for name, p in params if not p.ndim or p.shape[0] != count]
        if not isinstance(count, int) or not params or wrong or not has_forward(module):
            what = (
                "no int attribute num_experts"
                if not isinstance(count, int)
                else f"parameters {wrong[:2]} whose first dimension is not num_experts={count}"
                if wrong
                else "no parameters or no forward()"
            )
            raise PlanError(
                f"{plan.description}.{fqn} ({type(module).__name__}) is declared an experts module but has {what}; "
                f"{EXPERTS_CONTRACT}. Fix: make it follow that contract, or leave it out of experts_plan."
            )
        if count % ep:
            fits = [d for d in range(1, count + 1) if count % d == 0]
            raise PlanError(
                f"mesh_shape has ep={ep}, which does not divide the {count} experts of {plan.description}.{fqn}: each "
                f"ep rank holds num_experts / ep whole experts. Fix: an ep that divides {count} "
                f"({', '.join(map(str, fits))}), giving the other ranks to fsdp, e.g. {_kept_ep(count, ep)}."
            )
    return [fqn for fqn, _ in named]


def _kept_ep(num_experts: int, ep: int) -> str:
    """A mesh that keeps expert parallelism for `num_experts` experts in place of an `ep` that does not divide them:
    the largest ep dividing both (on the same ranks, fsdp taking those it frees), else the ep dividing the experts
    nearest below `ep`, else above (on a world that it divides)."""
    divisors = [d for d in range(2, num_experts + 1) if num_experts % d == 0]
    if not divisors:
        return 'mesh_shape [[-1], ["fsdp"]] (a single expert: nothing to divide)'
    same_ranks = [d for d in divisors if ep % d == 0]
    if same_ranks:
        return f'mesh_shape [[-1, {same_ranks[-1]}], ["fsdp", "ep"]] (fsdp takes the ranks ep={same_ranks[-1]} frees)'
    other = max((d for d in divisors if d < ep), default=divisors[0])
    return f'mesh_shape [[-1, {other}], ["fsdp", "ep"]] (on a world that {other} divides, fsdp taking the rest)'


def gathered_inside(styles: Mapping[str, Any]) -> dict[str, str]:
    """{column-wise layer: the `gather_input` module around it}: the layers whose input their module gathers."""
    gathers = [fqn for fqn, style in styles.items() if style == "gather_input"]
    inside = {}
    for fqn, style in styles.items():
        around = [g for g in gathers if fqn.startswith(f"{g}.")]
        if around and style in GATHERING_STYLES:
            inside[fqn] = around[0]
    return inside


def _check_divisible(model: nn.Module, fqn: str, module: nn.Module, style: str, tp: int) -> None:
    dims: dict[str, int] = {}
    if isinstance(module, nn.Linear):
        dims = {"in_features": module.in_features} if style in ("rowwise", "rowwise_split_input") else {}
        if style in ("colwise", "vocab_head"):
            dims = {"out_features": module.out_features}
    elif isinstance(module, nn.Embedding) and style in ("vocab_embedding", "vocab_embedding_whole"):
        dims = {"num_embeddings": module.num_embeddings}
    for dim, size in dims.items():
        if size % tp:
            raise PlanError(
                f"{type(model).__name__}.{fqn} ({style}) has {dim}={size}, which tp={tp} does not divide. "
                f"Fix: choose a tp that divides {size}, or resize the model."
            )


def _check_divisors(plan: ParallelPlan, tp: int) -> None:
    """Every count the plan says tp must divide (head counts: a rank must hold whole heads)."""
    for what, count in plan.tp_divisors.items():
        if count % tp:
            fits = [d for d in range(1, count + 1) if count % d == 0]
            fewer = max(d for d in fits if tp % d == 0)  # keeps the world size: fsdp grows by tp / fewer
            raise PlanError(
                f"{plan.description} has {count} {what}, which tp={tp} does not divide: a tensor-parallel rank "
                f"must hold whole heads. Fix: a tp that divides {count} ({', '.join(map(str, fits))}), e.g. "
                f'mesh_shape [[-1, {fewer}], ["fsdp", "tp"]].'
            )


def fsdp_unit_names(model: nn.Module, plan: ParallelPlan) -> list[str]:
    """The modules to shard as their own FSDP groups (the root is wrapped separately, last).

    From the plan's `fsdp_units` globs when declared; otherwise each child of the model's largest `nn.ModuleList`
    (the transformer blocks in most models).
    """
    if plan.fsdp_units is not None:
        return [fqn for fqn, _ in select(model, plan.fsdp_units, "fsdp_units")]
    lists = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    fqn, largest = max(lists, key=lambda item: len(item[1]))
    return [f"{fqn}.{name}" for name, _ in largest.named_children()]


def pipeline_layer_names(model: nn.Module, plan: ParallelPlan) -> list[str]:
    """The plan's `pipeline_layers` globs expanded to module names, in execution order.

    Each layer's output feeds the next; every parameter must live in exactly one layer.
    """
    if plan.pipeline_refusal:
        raise PlanError(f"{plan.description}: {plan.pipeline_refusal}")
    declared = plan.pipeline_layers
    if not declared:
        raise PlanError(
            f"pipeline parallelism needs {plan.description}.pipeline_layers: module names in execution "
            "order, each layer's output feeding the next, e.g. ['tok_emb', 'blocks.*', 'norm', 'head'], and a "
            "pipeline_loss(output, target) method."
        )
    names = []
    for pattern in declared:
        names += [fqn for fqn, _ in select(model, [pattern], "pipeline_layers") if fqn not in names]
    for name in names:
        if not has_forward(model.get_submodule(name)):
            raise PlanError(
                f"{type(model).__name__}.pipeline_layers entry {name} ({type(model.get_submodule(name)).__name__}) "
                "has no forward(): a pipeline stage calls each layer on the previous one's output. Fix: list the "
                f"modules it holds in execution order instead (e.g. '{name}.*'), or give it a forward()."
            )
    owners: dict[int, str] = {}
    for name in names:
        for param_name, param in model.get_submodule(name).named_parameters():
            if id(param) in owners:
                raise PlanError(
                    f"{plan.description}.{name}.{param_name} is the same tensor as {owners[id(param)]}: tied "
                    "weights cannot be split across pipeline stages. Untie them (e.g. separate embedding and head; "
                    "for a Hugging Face model, tie_word_embeddings: false in its config), or train without pipeline "
                    "parallelism (fsdp_tp)."
                )
            owners[id(param)] = f"{name}.{param_name}"
    outside = [n for n, p in model.named_parameters() if id(p) not in owners]
    if outside:
        raise PlanError(
            f"{type(model).__name__} has parameters outside pipeline_layers: {', '.join(outside[:5])}. Every "
            "parameter must belong to one listed layer; add its module to pipeline_layers."
        )
    return names


def has_forward(module: nn.Module) -> bool:
    """False for containers such as `nn.ModuleDict`/`nn.ModuleList`, which are never called: hooks on them never run."""
    return type(module).forward is not nn.Module.forward


def split_stages(
    model: nn.Module, layers: Sequence[str], num_stages: int, split_points: Sequence[int | str] | None = None
) -> list[list[str]]:
    """Cut `layers` into `num_stages` contiguous stages.

    `split_points`: where each stage after the first begins, as layer indices or names. Without them, stages
    are balanced by parameter count (the largest stage as small as possible); the first and last stages,
    which hold the embedding and the head, so get fewer blocks.
    """
    if num_stages > len(layers):
        raise PlanError(
            f"{num_stages} pipeline stages need at least {num_stages} pipeline layers, but "
            f"{type(model).__name__} has {len(layers)} ({', '.join(layers)}). Fix: fewer stages (pp x "
            "stages_per_rank) or a deeper model."
        )
    if split_points is not None:
        starts = [layers.index(p) if isinstance(p, str) and p in layers else p for p in split_points]
        if (
            len(starts) != num_stages - 1
            or any(not isinstance(s, int) for s in starts)
            or starts != sorted(set(starts))
            or not all(0 < s < len(layers) for s in starts)
        ):
            raise PlanError(
                f"split_points={split_points} must name {num_stages - 1} distinct, increasing layer indices "
                f"(1..{len(layers) - 1}) or layer names for {num_stages} stages; layers: {', '.join(layers)}."
            )
    else:
        sizes = [max(sum(p.numel() for p in model.get_submodule(n).parameters()), 1) for n in layers]
        starts = _balanced_starts(sizes, num_stages)
    bounds = [0, *starts, len(layers)]
    return [layers[a:b] for a, b in zip(bounds, bounds[1:])]


def _balanced_starts(sizes: list[int], num_stages: int) -> list[int]:
    """Stage start indices minimising the largest stage's total size (exact, by dynamic programming)."""
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[s][i]: the smallest possible largest load when the first i layers form s stages; cut[s][i]: where
    # the last of those stages starts.
    n = len(sizes)
    best = [[float("inf")] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for stages in range(1, num_stages + 1):
        for end in range(stages, n + 1):
            for start in range(stages - 1, end):
                load = max(best[stages - 1][start], prefix[end] - prefix[start])
                if load < best[stages][end]:
                    best[stages][end], cut[stages][end] = load, start
    starts, end = [], n
    for stages in range(num_stages, 1, -1):
        end = cut[stages][end]
        starts.append(end)
    return sorted(starts)
