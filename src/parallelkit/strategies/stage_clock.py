"""How long a rank's pipeline stages compute within a schedule step; the rest of the step is the bubble."""

from __future__ import annotations

import functools
import time
from typing import Any

import torch


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
