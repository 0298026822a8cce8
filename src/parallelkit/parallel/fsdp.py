"""FSDP2: each fsdp unit, then the root (the model, or a pipeline stage), fully sharded over the data-parallel mesh."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from parallelkit.adapters.nf4 import is_nf4
from parallelkit.errors import PlanError
from parallelkit.parallel.resolve import has_forward

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

Unit = nn.Module | list[nn.Module]
"""An fsdp unit as FSDP2 takes it: a module, or a list of modules sharded (and gathered) as one group."""


def runnable_unit(model_name: str, fqn: str, module: nn.Module) -> Unit:
    """`module` as an fsdp unit: itself, or for a container without forward (e.g. a block written as an
    `nn.ModuleDict`) its children as one group, since FSDP2 gathers a unit in the forward hooks of its modules."""
    if has_forward(module):
        return module
    children = list(module.named_children())
    uncallable = [name for name, child in children if not has_forward(child)]
    if not children or uncallable:
        inner = f"{fqn}.{uncallable[0]}" if uncallable else fqn
        raise PlanError(
            f"{model_name}.fsdp_units entry {fqn} ({type(module).__name__}) has no forward(), and "
            f"{'neither does its child ' + inner if uncallable else 'no children to shard in its place'}: FSDP2 "
            "gathers a unit's parameters when the unit is called, and this one never is. Fix: name the modules "
            f"that are called as units instead, e.g. fsdp_units = ['{inner}.*'], or give the block a forward()."
        )
    return [child for _, child in children]


@dataclass(frozen=True)
class DataParallelWrap:
    """Whether FSDP2 wraps the model over its data-parallel mesh, and what the strategy does by hand where it does not.

    `parallelize` makes it once per model (FSDP left out where `fsdp_needed` says it would change nothing) and records
    it on the model; the strategy reads it (`data_parallel_wrap`) instead of looking at the model again. Without FSDP,
    tensor and expert parallelism's DTensors sit beside the plain tensors tensor parallelism leaves whole, and no
    FSDP reduction gives their gradients their parameters' placements."""

    fsdp: bool
    """FSDP2 wraps every root: its reduction settles gradients, and it holds them back while accumulating."""
    settle_gradients: bool
    """No FSDP, and DTensor parameters: after each backward `parallelkit.optimizers.grad_norm.settle_gradients` gives
    every DTensor gradient its parameter's placements (not on accumulation micro-steps, where pending sums add up)."""
    replicate_plain_tensors: bool
    """DTensors beside plain parameters: an optimizer that updates both takes the plain ones as replicated DTensors
    (`parallelkit.optimizers.compiled.replicate_plain_tensors`; a foreach update refuses the mix)."""

    @classmethod
    def of(cls, modules: Iterable[nn.Module], *, fsdp: bool) -> DataParallelWrap:
        """The wrap of `modules` (the parallelised roots), FSDP2 around them or not."""
        from torch.distributed.tensor import DTensor

        kinds = {isinstance(param, DTensor) for module in modules for param in module.parameters()}
        return cls(fsdp=fsdp, settle_gradients=not fsdp and True in kinds, replicate_plain_tensors=len(kinds) == 2)


_RECORDED = "_parallelkit_data_parallel_wrap"
"""The attribute `parallelize` records a model's `DataParallelWrap` under."""


def record_wrap(model: nn.Module, wrap: DataParallelWrap) -> None:
    """Record `wrap` on `model`, for `data_parallel_wrap` to read."""
    setattr(model, _RECORDED, wrap)


def data_parallel_wrap(model: nn.Module) -> DataParallelWrap:
    """The `DataParallelWrap` `parallelize` recorded on `model`; for a model that parallelised itself (its own
    `configure_model()`), the one its parameters show: FSDP2 if it wrapped itself, DTensors if it made any."""
    from torch.distributed.fsdp import FSDPModule

    recorded = getattr(model, _RECORDED, None)
    return recorded if recorded is not None else DataParallelWrap.of([model], fsdp=isinstance(model, FSDPModule))


def fsdp_needed(
    model: nn.Module, dp_mesh: DeviceMesh | None, *, param_dtype: Any = None, comm_hook: Any = None, cpu_offload: bool
) -> bool:
    """Whether FSDP2 over `dp_mesh` would change anything for `model`: shard (more than one rank), offload, cast (a
    `param_dtype` some floating parameter does not have already), round gradients (a comm hook's `reduce_dtype`
    narrower than a parameter's) or reduce them its own way (a hook that overrides `configure`).

    Over one rank with none of these it would only copy every parameter into its unsharded buffer before the forward
    and every gradient through the reduce-scatter path after the backward (`benchmarks/strategies.py`, tensor
    parallelism alone). What leaving it out asks of the strategy is the model's `DataParallelWrap`."""
    from parallelkit.comm import CommHook

    if dp_mesh is None:
        return False
    if dp_mesh.size() > 1 or cpu_offload:
        return True
    if comm_hook is not None and type(comm_hook).configure is not CommHook.configure:
        return True
    dtypes = {param.dtype for param in model.parameters() if param.is_floating_point()}
    reduce_dtype = getattr(comm_hook, "reduce_dtype", None)
    rounds = reduce_dtype is not None and any(
        torch.finfo(reduce_dtype).bits <= torch.finfo(dtype).bits and dtype != reduce_dtype for dtype in dtypes
    )
    return rounds or (param_dtype is not None and dtypes != {param_dtype})


def apply_fsdp(
    root: nn.Module,
    units: list[Unit],
    dp_mesh: DeviceMesh,
    *,
    param_dtype: Any = None,
    comm_hook: Any = None,
    reshard_after_forward: str = "default",
    cpu_offload: bool = False,
    experts: list[nn.Module] = (),
    experts_mesh: DeviceMesh | None = None,
    prepare: Callable[[nn.Module], Any] | None = None,
) -> None:
    """fully_shard each fsdp unit, then the root, over `dp_mesh` (2-D replicate x fsdp means HSDP).

    `experts` (modules whose parameters expert parallelism divided over the ep axis) are sharded first, each as its
    own group, over `experts_mesh` (the data-parallel axes other than ep); without one their parameters are left out
    of every group (each rank holds its experts whole, and nothing needs reducing).

    `reshard_after_forward`: "always" frees every gathered weight after its forward, "never" keeps them all,
    "default" frees all but the last unit and the root: backward needs those first, so freeing them would
    only repeat their all-gather at once. `comm_hook` (a `parallelkit.comm.CommHook`) sets the gradient
    reduction dtype and may replace the reduce-scatter of every module it shards. `prepare(module)` runs on each
    experts module, unit and then the root just before it is sharded, so what it makes whole (QLoRA's NF4 weights) is
    whole one unit at a time.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    options = {
        "mesh": dp_mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=comm_hook.reduce_dtype if comm_hook is not None else None
        ),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    ignored = {param for module in experts for param in module.parameters()} if experts_mesh is None else set()
    prepare = prepare or (lambda _: None)
    if experts_mesh is not None:
        for module in experts:
            prepare(module)
            fully_shard(
                module, reshard_after_forward=reshard_after_forward != "never", **{**options, "mesh": experts_mesh}
            )

    def shard(group: nn.Module | list[nn.Module], reshard: bool) -> None:
        modules = group if isinstance(group, list) else [group]
        for module in modules:
            prepare(module)
        skip = set(ignored)
        if dp_mesh.size() == 1:  # each rank holds every NF4 weight anyway (FSDP2's one-rank gather skips torchao's)
            skip |= {param for module in modules for param in module.parameters() if is_nf4(param)}
        fully_shard(group, reshard_after_forward=reshard, **options, ignored_params=skip or None)

    for index, unit in enumerate(units):
        last = index == len(units) - 1
        shard(unit, reshard_after_forward == "always" or (reshard_after_forward == "default" and not last))
    # The root holds what no unit does (embeddings, final norm, head).
    shard(root, reshard_after_forward == "always")
    if comm_hook is not None:
        # A group's modules share one FSDP state: configuring its first module configures the group.
        for module in (*(experts if experts_mesh is not None else ()), *units, root):
            comm_hook.configure(module[0] if isinstance(module, list) else module)
