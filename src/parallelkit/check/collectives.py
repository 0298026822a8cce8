"""The collectives `parallelkit check` times over each mesh axis: which ones an axis runs, the groups of ranks an
axis splits into, one call run on this rank's part, and a timed call's figures.

Bandwidths follow nccl-tests' definitions (its doc/PERFORMANCE.md): for a collective over n ranks on a buffer of S
bytes taking t seconds, algbw = S / t and busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather,
reduce-scatter and all-to-all (S their whole buffer: all-gather's output, reduce-scatter's input), x 1 for
send/recv; a group's time is its slowest rank's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parallelkit.mesh import MeshSpec

BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}
"""nccl-tests' bus bandwidth factor per collective, for a group of n ranks."""


@dataclass
class Measurement:
    """One collective at one size on one axis: every group of the axis ran it at once."""

    axis: str
    op: str
    size: int
    group_size: int
    seconds: dict[tuple[int, ...], float] = field(default_factory=dict)  # group ranks -> its slowest rank's time

    def busbw(self, group: tuple[int, ...]) -> float:
        return self.size / self.seconds[group] * BUS_FACTOR[self.op](self.group_size)

    @property
    def slowest(self) -> tuple[int, ...]:
        return max(self.seconds, key=self.seconds.get)

    def as_dict(self) -> dict[str, Any]:
        slow = self.slowest
        return {
            "axis": self.axis,
            "op": self.op,
            "bytes": self.size,
            "group_size": self.group_size,
            "latency_us": self.seconds[slow] * 1e6,
            "algbw_gbps": self.size / self.seconds[slow] / 1e9,
            "busbw_gbps": self.busbw(slow) / 1e9,
            "slowest_group": list(slow),
            "groups": {",".join(map(str, g)): s * 1e6 for g, s in self.seconds.items()},
        }


def axis_groups(spec: MeshSpec, axis: str) -> list[tuple[int, ...]]:
    """Every group of `axis`: the ranks that share their coordinates on every other axis, in rank order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(spec.world_size):
        coords = spec.coordinates(rank)
        groups.setdefault(tuple(v for k, v in coords.items() if k != axis), []).append(rank)
    return [tuple(g) for g in groups.values()]


def ops_of(axis: str) -> tuple[str, ...]:
    """The collectives training runs over an axis: point-to-point between stages on pp, all-to-all on ep (the tokens
    to their experts) and cp too (Ulysses' heads; the all-gather method gathers keys and values)."""
    if axis == "pp":
        return ("send_recv",)
    if axis in ("ep", "cp"):
        return ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    return ("all_reduce", "all_gather", "reduce_scatter")


def run_collective(op: str, size: int, group: Any, ranks: tuple[int, ...], rank: int, device: torch.device) -> None:
    """One `op` on a buffer of `size` bytes (nccl-tests' S) over `group`, this rank's part of it."""
    n = len(ranks)
    whole = torch.ones(size // 4, device=device)
    part = torch.empty(size // 4 // n, device=device)
    if op == "all_reduce":
        dist.all_reduce(whole, group=group)
    elif op == "all_gather":
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(
            whole, part, group=group
        )  # new name, torch 2.13
    elif op == "reduce_scatter":
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(part, whole, group=group)
    elif op == "all_to_all":
        dist.all_to_all_single(torch.empty_like(whole), whole, group=group)
    elif op == "send_recv":  # a ring over the stages: each sends to the next and receives from the previous
        here = ranks.index(rank)
        ops = [
            dist.P2POp(dist.isend, whole, ranks[(here + 1) % n], group),
            dist.P2POp(dist.irecv, torch.empty_like(whole), ranks[(here - 1) % n], group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    else:
        raise ValueError(op)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def size_text(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"
