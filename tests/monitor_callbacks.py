"""Callbacks tests/test_monitors.py names by class_path in the runs it launches (tests/ is on their PYTHONPATH)."""

from __future__ import annotations

import time

import lightning as L


class SlowRank(L.Callback):
    """Makes one rank a straggler: it sleeps `seconds` in every optimizer step, after the step's last collective
    (before the optimizer's own update, which is local), so only its own step time grows; the other ranks wait
    for it outside their step, in RankMonitor's gather."""

    def __init__(self, rank: int, seconds: float) -> None:
        self.rank = rank
        self.seconds = seconds

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)
