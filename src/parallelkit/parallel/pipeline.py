"""Pipeline split: a model's pipeline layers cut into contiguous stages, and a stage as a module of its own.

The stage split is resolution (`resolve(..., num_stages=...)` calls `split_stages`); `split_model` makes this rank's
stages and drops every other layer, before the stages are parallelised one by one (`parallelize`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from torch import nn

from parallelkit.contract import ParallelPlan
from parallelkit.errors import PlanError

if TYPE_CHECKING:
    from parallelkit.parallel.resolve import ResolvedPlan


def split_model(model: nn.Module, resolved: ResolvedPlan, indices: Sequence[int]) -> list[StageModule]:
    """This rank's stages (`indices` into `resolved.stages`) as `StageModule`s; the other stages' layers are dropped
    from `model`, whose other names stay as they were."""
    if resolved.stages is None:
        raise PlanError(f"{resolved.description}: the plan was resolved without pipeline stages (num_stages).")
    stages = [resolved.stages[i] for i in indices]
    kept = {name for stage in stages for name in stage}
    drop_layers(model, [name for name in resolved.pipeline_layers if name not in kept])
    return [StageModule(model, stage, resolved.plan) for stage in stages]


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


class StageModule(nn.Module):
    """The layers of one pipeline stage, registered under their original names (`blocks.3` stays `blocks.3`),
    so state dicts, and so checkpoints, are the same whatever the layout. Run as the plan's `stage_forward` says
    (by default, each layer on the previous one's output)."""

    def __init__(self, model: nn.Module, layers: Sequence[str], plan: ParallelPlan) -> None:
        super().__init__()
        for name in [*layers, *plan.stage_modules]:
            if name in plan.stage_modules and any(True for _ in model.get_submodule(name).parameters()):
                raise PlanError(
                    f"{plan.description}: stage module {name} holds parameters; every pipeline stage gets it, "
                    "so it must hold buffers only (list it in pipeline_layers instead)."
                )
            *parents, leaf = name.split(".")
            owner: nn.Module = self
            for part in parents:
                if getattr(owner, part, None) is None:
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            owner.add_module(leaf, model.get_submodule(name))
        self.layer_names = list(layers)
        self._layers = [(name, self.get_submodule(name)) for name in layers]  # a plain list: not registered twice
        self._forward = plan.stage_forward

    def forward(self, *args: Any) -> Any:
        if self._forward is not None:
            return self._forward(self._layers, *args)
        (x,) = args
        for _, layer in self._layers:
            x = layer(x)
        return x


def drop_layers(model: nn.Module, layers: Iterable[str]) -> None:
    """Remove `layers` from `model` in place (their slots become None), keeping every other name unchanged."""
    for name in layers:
        parent, _, leaf = name.rpartition(".")
        (model.get_submodule(parent) if parent else model).register_module(leaf, None)
