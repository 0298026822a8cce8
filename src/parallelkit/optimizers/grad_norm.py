"""Global gradient norm and clipping over gradients sharded any way: plain tensors and DTensors on any mesh.

`torch.nn.utils.clip_grad_norm_` needs every gradient on one mesh; after TP without sequence parallelism (or
across pipeline stages) some gradients are plain tensors and the others DTensors on different meshes. Here
each layout contributes its local sum of |g|^p, reduced over exactly the mesh axes on which it is sharded
(replicated axes hold copies and must not be counted twice), then the stages' sums are added.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def _local_parts(grads: Iterable[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """Local shards grouped by layout: (mesh, placements) for DTensors, None for plain tensors."""
    parts: dict[object, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                # A pending sum cannot be normed piecewise: (a + b)^2 != a^2 + b^2.
                grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])
            parts[(grad.device_mesh, tuple(grad.placements))].append(grad.to_local())
        else:
            parts[None].append(grad)
    return parts


def global_grad_norm(
    grads: Iterable[torch.Tensor], norm_type: float = 2.0, stage_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The norm of all gradients as if they were one unsharded vector, identical on every rank.

    `stage_group` joins ranks that hold different parameters outside any DTensor mesh (pipeline stages).
    """
    infinite = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM
    total: torch.Tensor | None = None
    for layout, tensors in _local_parts(grads).items():
        device = tensors[0].device
        norms = torch.stack([torch.linalg.vector_norm(t.float(), norm_type) for t in tensors]).to(device)
        part = norms.max() if infinite else norms.pow(norm_type).sum()
        if layout is not None:
            mesh, placements = layout
            for axis, placement in enumerate(placements):
                # Not is_shard(): FSDP over TP gives _StridedShard, which is a shard but not a Shard.
                if not placement.is_replicate():
                    dist.all_reduce(part, op=op, group=mesh.get_group(axis))
        total = part if total is None else (torch.maximum(total, part) if infinite else total + part)
    if total is None:
        total = torch.zeros(())
    if stage_group is not None:
        dist.all_reduce(total, op=op, group=stage_group)
    return total if infinite else total.pow(1.0 / norm_type)


def settle_gradients(module: torch.nn.Module) -> None:
    """Give every DTensor gradient its parameter's placements: a pending sum (`Partial`: tensor parallelism leaves a
    sequence-parallel norm's weight gradient so) is all-reduced once; a whole gradient of a sharded parameter (a
    row-wise embedding's comes out replicated) keeps this rank's shard and frees the rest.

    FSDP does this in its reduction. Without FSDP (one data-parallel rank; the model's `DataParallelWrap`, in
    `parallelkit.parallel.fsdp`, says so) the optimizer would otherwise redistribute the same gradient again in every
    operation that meets it (AdamW: twice per parameter and step), and a whole embedding gradient would stay allocated
    on every tp rank."""
    for param in module.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    stage_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Scale gradients in place so their global norm is at most `max_norm`; returns the norm before clipping."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = global_grad_norm(grads, norm_type, stage_group)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.mul_(coef.to(local.device, local.dtype))
    return total
