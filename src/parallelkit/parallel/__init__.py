"""Parallel techniques, one module each, and `parallelize`, which applies them in the one fixed order.

- `resolve`: a model's declared plan resolved for a layout (names, checks, stages): read by everything below;
- `pipeline`: the stage split; `tensor_parallel`; `expert_parallel`; `context_parallel`; `activation_checkpoint`;
  `compile`; `fsdp`.

The order, per root (the model, or each of this rank's pipeline stages): pipeline split -> tensor parallel -> expert
parallel -> context parallel (the attention modules attend across the cp ranks' slices of the sequence) -> activation
checkpointing -> compile -> FSDP. The split comes first so each stage is parallelised on its
own; tensor and expert parallelism before FSDP, which shards the DTensors they made (tp never splits an experts
module, so the two are independent); checkpointing inside the FSDP units, so the recompute
sees gathered parameters; the compiled blocks see tensor parallelism's collectives but not FSDP's. A new technique
gets a module here and a line in `parallelize` (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from parallelkit.errors import PlanError
from parallelkit.mesh import dense_mesh, expert_data_mesh
from parallelkit.parallel.activation_checkpoint import apply_activation_checkpointing, checkpointed_modules
from parallelkit.parallel.compile import apply_compile
from parallelkit.parallel.context_parallel import apply_context_parallel
from parallelkit.parallel.expert_parallel import apply_expert_parallel
from parallelkit.parallel.fsdp import (
    DataParallelWrap,
    apply_fsdp,
    data_parallel_wrap,
    fsdp_needed,
    record_wrap,
    runnable_unit,
)
from parallelkit.parallel.pipeline import split_model
from parallelkit.parallel.resolve import ResolvedPlan, resolve
from parallelkit.parallel.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    resolved: ResolvedPlan | None = None,
    stages: Sequence[int] | None = None,
    activation_checkpointing: str | int = "none",
    compile: str | None = None,
    reshard_after_forward: str = "default",
    param_dtype: Any = None,
    comm_hook: Any = None,
    cpu_offload: bool = False,
    prepare: Callable[[nn.Module], Any] | None = None,
) -> list[nn.Module]:
    """Make `model` parallel over `mesh` as `resolved` (the strategy's `ResolvedPlan`) says; None resolves the model's
    plan for `mesh` here, as a call outside a strategy needs. Returns the modules to run: `[model]`, or with `stages`
    (indices into `resolved.stages`: this rank's) one `StageModule` per stage, the other layers dropped.

    `compile`: the `torch.compile` backend for each block, or None (eager). `comm_hook`: a `parallelkit.comm.CommHook`
    for the gradient reduction. `prepare(module)`: what the caller changes in a module's parameters before FSDP
    shards them (QLoRA's base weights become NF4 there): each unit just before it is sharded, then the root; without
    FSDP, each root after tensor and expert parallelism.

    FSDP is left out where it would change nothing (`fsdp_needed`: one data-parallel rank, nothing to cast, offload,
    or round in the gradient reduction); the parameters are then plain tensors, or tensor parallelism's DTensors.
    The decision and what it asks of the caller is recorded on `model` as its `DataParallelWrap`
    (`data_parallel_wrap(model)` reads it).
    """
    sizes = dict(zip(mesh.mesh_dim_names or (), mesh.shape))
    if resolved is None:
        if stages is not None:
            raise PlanError("parallelize(stages=...) needs the plan resolved with its stages: resolve(num_stages=...).")
        resolved = resolve(model, tp=sizes.get("tp", 1), ep=sizes.get("ep", 1), cp=sizes.get("cp", 1))
    if (resolved.tp_size, resolved.ep_size, resolved.cp_size) != tuple(sizes.get(a, 1) for a in ("tp", "ep", "cp")):
        raise PlanError(  # a plan resolved for other axis sizes would leave the mesh's axes half applied
            f"the plan was resolved for tp={resolved.tp_size}, ep={resolved.ep_size}, cp={resolved.cp_size}, the mesh "
            f"has {sizes}. Fix: resolve(model, tp=..., ep=..., cp=...) with the mesh's sizes."
        )
    name = type(model).__name__
    roots = [model] if stages is None else split_model(model, resolved, stages)
    dp_mesh = dense_mesh(mesh)  # HSDP (2-D) with a replicate axis: replicate across, shard within
    if not fsdp_needed(model, dp_mesh, param_dtype=param_dtype, comm_hook=comm_hook, cpu_offload=cpu_offload):
        dp_mesh = None  # one data-parallel rank, nothing to cast, offload or round: FSDP would only copy
    for root in roots:
        if resolved.tp_size > 1:
            apply_tensor_parallel(root, mesh["tp"], resolved)
        experts = apply_expert_parallel(root, mesh["ep"], resolved) if resolved.ep_size > 1 else []
        if resolved.cp_size > 1:
            apply_context_parallel(root, mesh["cp"], resolved.attention, resolved.cp_method, model)
        if prepare is not None and dp_mesh is None:
            prepare(root)  # with FSDP, each unit just before it is sharded (its full-size parameters one at a time)
        held = dict(root.named_modules())
        units = [runnable_unit(name, fqn, held[fqn]) for fqn in resolved.fsdp_units if fqn in held]
        if compile is None:
            apply_activation_checkpointing(units, activation_checkpointing)
        else:
            apply_compile(units, compile, checkpointed_modules(units, activation_checkpointing))
        if dp_mesh is not None:
            apply_fsdp(
                root,
                units,
                dp_mesh,
                param_dtype=param_dtype,
                comm_hook=comm_hook,
                reshard_after_forward=reshard_after_forward,
                cpu_offload=cpu_offload,
                experts=experts,
                experts_mesh=expert_data_mesh(mesh),
                prepare=prepare,
            )
    record_wrap(model, DataParallelWrap.of(roots, fsdp=dp_mesh is not None))
    return roots


__all__ = ["DataParallelWrap", "ResolvedPlan", "data_parallel_wrap", "parallelize", "resolve"]
