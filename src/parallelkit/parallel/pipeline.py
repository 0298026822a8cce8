"""Pipeline stages as modules: `split_model` makes this rank's stages of a resolved plan and drops every other layer,
before the stages are parallelised one by one (`parallelize`). Where the stages are cut is resolution
(`resolve.split_stages`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from parallelkit.contract import ParallelPlan
from parallelkit.errors import PlanError
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
