"""How long a rank's pipeline stages compute within a schedule step; the rest of the step is the bubble."""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
import torch.distributed as dist


class StageClock:
    """Time this rank's pipeline stages spend computing forward and backward chunks within one schedule step.

    Everything else in the step (waiting for a neighbour's activations or gradients, or for nothing at all)
    is the bubble.
    """

    ACTIONS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, stages: list[Any], device: torch.device) -> None:
        self._sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self._busy = 0.0
        self._start = 0.0
        for stage in stages:
            for action in self.ACTIONS:
                setattr(stage, action, self._timed(getattr(stage, action)))

    def _timed(self, action: Any) -> Any:
        @functools.wraps(action)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._sync()
            begin = time.perf_counter()
            try:
                return action(*args, **kwargs)
            finally:
                self._sync()
                self._busy += time.perf_counter() - begin

        return timed

    def start(self) -> None:
        self._sync()
        self._busy, self._start = 0.0, time.perf_counter()

    def stop(self) -> tuple[float, float]:
        """(busy seconds, step seconds) since `start`."""
        self._sync()
        return self._busy, time.perf_counter() - self._start

    def log(self, module: Any, group: Any, device: torch.device, theoretical_bubble: float | None) -> None:
        """Log the step since `start`, on rank 0, for every rank of the pipeline `group`: its busy seconds and bubble,
        the pipeline's bubble, and the ideal schedule's."""
        busy, wall = self.stop()
        times = [torch.zeros(2, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(times, torch.tensor([busy, wall], device=device), group=group)
        for rank, (rank_busy, rank_wall) in enumerate(times):
            module.log(f"pp_busy_s/rank{rank}", rank_busy.item(), on_step=True, rank_zero_only=True)
            module.log(f"pp_bubble/rank{rank}", 1 - (rank_busy / rank_wall).item(), on_step=True, rank_zero_only=True)
        bubble = 1 - sum(b for b, _ in times).item() / sum(w for _, w in times).item()
        module.log("pp_bubble", bubble, on_step=True, prog_bar=True, rank_zero_only=True)
        if theoretical_bubble is not None:
            module.log("pp_bubble_theory", theoretical_bubble, on_step=True, rank_zero_only=True)
