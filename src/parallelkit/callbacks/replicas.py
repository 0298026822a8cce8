"""Replica consistency: the parameters every rank of a group must hold identically, compared every few steps.

A parameter is a replica along a mesh axis when the axis does not shard it: data-parallel replicas (DDP, HSDP's
`replicate` axis), and tensor-parallel ranks for what tp leaves whole (norms, per-head norms, biases of row-wise
layers, the embeddings of a plan that does not split them). Those copies only stay equal if every rank applies the
same update, which a gradient reduced over too few ranks breaks silently: a per-head norm whose gradient is not
summed over tp trains each tp rank's copy apart while the loss still looks fine. This monitor catches it.

Every `every_n_steps` optimizer steps, each rank fingerprints its local copy of each replicated parameter (three
float64 numbers: the sum, the 2-norm and the sum of every 7th element) and, per mesh axis, the ranks of the axis's
group exchange them in one all-gather; a parameter whose fingerprints differ is named with the ranks that hold
another copy than the group's first rank. Which axes shard a parameter comes from the parameter itself (its DTensor
placements and the ranks of their groups), so FSDP, tp, ep and their flattened meshes need no table here; pipeline
stages hold different layers and are never compared.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from typing_extensions import override

from parallelkit.errors import ParallelkitError

log = logging.getLogger("parallelkit")


class ReplicaMismatch(ParallelkitError):
    """Replicated parameters differ across ranks (`ReplicaMonitor(on_mismatch="raise")`)."""


@dataclass
class Axis:
    """One mesh axis of this rank: its group, the group's global ranks, and the parameters replicated along it."""

    name: str
    group: Any
    ranks: tuple[int, ...]
    params: list[tuple[str, torch.Tensor]]


def _group_ranks(group: Any) -> set[int]:
    return set(dist.get_process_group_ranks(group))


def replicated_along(param: torch.Tensor, ranks: set[int], rank: int) -> bool:
    """Whether `param`'s local tensor is the same piece on every rank of `ranks` (a group this rank is in): no
    dimension of its DTensor mesh that shards it has another of those ranks in this rank's group."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return True
    mesh = param.device_mesh
    for dim, placement in enumerate(param.placements):  # Shard, FSDP's _StridedShard over tp's Shard
        if not placement.is_replicate() and _group_ranks(mesh.get_group(dim)) & ranks != {rank}:
            return False
    return True


def mesh_axes(strategy: Any) -> list[tuple[str, Any]]:
    """(axis name, process group) of every axis of size > 1 along which ranks may hold replicas: the strategy's mesh
    axes but pp, or the whole world for a strategy without a mesh (DDP)."""
    spec = getattr(strategy, "mesh_spec", None)
    mesh = getattr(strategy, "device_mesh", None) if spec is not None else None
    if mesh is None:
        return [("world", dist.group.WORLD)] if dist.is_initialized() and dist.get_world_size() > 1 else []
    return [(name, mesh.get_group(name)) for name, size in zip(spec.names, spec.sizes) if size > 1 and name != "pp"]


def fingerprints(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(len(tensors), 3) float64: each local tensor's sum, 2-norm and the sum of every 7th element (so that two
    copies holding the same values in another order differ too), accumulated in float64 without a float64 copy."""
    rows = []
    for t in tensors:
        x = t.detach().flatten()
        f64 = torch.float64
        rows.append(torch.stack([x.sum(dtype=f64), torch.linalg.vector_norm(x, dtype=f64), x[::7].sum(dtype=f64)]))
    return torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64)


class ReplicaMonitor(L.Callback):
    """Every `every_n_steps` optimizer steps, compare the parameters that ranks hold as replicas (module docstring).

    A mismatch is logged as an error naming the parameter, the axis and the ranks, or raised with
    `on_mismatch="raise"` (on every rank at once). The number of parameters compared is logged as
    `replicas/compared` at each check.

    Args:
        every_n_steps: Optimizer steps between checks (each check reads every replicated parameter once and runs one
            small all-gather per mesh axis).
        on_mismatch: "log" (an error in the log, training goes on) or "raise" (a ReplicaMismatch ends the run).
        rtol: Relative difference of fingerprints that counts as a mismatch (replicas are updated by the same
            operations on the same values, so they agree to the bit unless something is wrong).
    """

    def __init__(self, every_n_steps: int = 100, on_mismatch: str = "log", rtol: float = 1e-6) -> None:
        if every_n_steps < 1 or on_mismatch not in ("log", "raise"):
            raise ParallelkitError(
                f"ReplicaMonitor(every_n_steps={every_n_steps}, on_mismatch={on_mismatch!r}): every_n_steps is a "
                "positive number of optimizer steps and on_mismatch 'log' or 'raise'. Fix: e.g. every_n_steps=100, "
                "on_mismatch='log'."
            )
        self.every_n_steps, self.on_mismatch, self.rtol = every_n_steps, on_mismatch, rtol
        self.axes: list[Axis] | None = None
        self.checked_step = -1
        self.mismatches: list[str] = []

    def _axes(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[Axis]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        axes = []
        for name, group in mesh_axes(trainer.strategy):
            ranks = _group_ranks(group)
            params = [(n, p) for n, p in pl_module.named_parameters() if replicated_along(p, ranks, rank)]
            axes.append(Axis(name, group, tuple(sorted(ranks)), params))
        return axes

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self.checked_step or step == 0 or step % self.every_n_steps:
            return
        self.checked_step = step
        if self.axes is None:
            self.axes = self._axes(trainer, pl_module)
        skipped = getattr(trainer.strategy, "axes_out_of_sync", set)()  # e.g. DiLoCo's replicas between syncs
        axes = [axis for axis in self.axes if axis.name not in skipped]
        found = [line for axis in axes if (line := self.compare(axis, step))]
        self.mismatches += found
        for line in found:
            log.error(line)
        compared = sum(len(axis.params) for axis in axes)
        pl_module.log("replicas/compared", float(compared), on_step=True, on_epoch=False, rank_zero_only=True)
        if self.on_mismatch == "raise" and self.axes:
            flag = torch.tensor([float(bool(found))], device=pl_module.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank raises, none waits in a collective
            if flag.item():
                raise ReplicaMismatch(
                    (
                        found[0]
                        if found
                        else f"replicated parameters differ across ranks at step {step} (another rank's log names them)"
                    )
                    + ". Fix: find the gradient that is not reduced over that axis (a custom module's parameter the "
                    "plan leaves whole but whose input tp splits), or a rank-dependent update."
                )

    def compare(self, axis: Axis, step: int) -> str | None:
        """The first parameter of `axis` whose copies differ in its group, described; None when all agree."""
        local = fingerprints([p.to_local() if hasattr(p, "to_local") else p for _, p in axis.params])
        local = local.to(next((p.device for _, p in axis.params), torch.device("cpu")))
        gathered = [torch.empty_like(local) for _ in axis.ranks]
        dist.all_gather(gathered, local, group=axis.group)
        table = torch.stack(gathered).cpu()  # (ranks, params, 3)
        first = table[0]
        differs = ~torch.isclose(table, first.expand_as(table), rtol=self.rtol, atol=0.0).all(dim=2)  # (ranks, params)
        if not differs.any():
            return None
        if dist.get_rank() != axis.ranks[0]:
            return None  # the group's first rank reports it, once
        index = int(differs.any(dim=0).nonzero()[0])
        odd = differs[:, index].nonzero().flatten().tolist()  # positions in the group
        more = int(differs.any(dim=0).sum()) - 1
        return (
            f"replica mismatch at step {step}: {axis.params[index][0]} differs on rank "
            f"{', '.join(str(axis.ranks[i]) for i in odd)} from rank {axis.ranks[0]} along the {axis.name} axis "
            f"(ranks {', '.join(map(str, axis.ranks))}), where it is replicated: sums "
            f"{table[odd[0], index, 0].item():.9g} vs {first[index, 0].item():.9g}"
            + (f"; {more} more parameters differ" if more else "")
        )
