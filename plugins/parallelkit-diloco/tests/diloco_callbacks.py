"""Callbacks the tests name by class_path in the runs they launch (this directory is on their PYTHONPATH)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import torch
from torch.distributed.tensor import DTensor


class SigtermAt(L.Callback):
    """Sends SIGTERM to this process once optimizer step `step` is done, on every rank: a preemption (SLURM and
    torchrun signal every process of the job) at a step the test chooses."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class RecordSyncs(L.Callback):
    """Writes what the outer step works on, per rank, to `dirpath`: `start.pt` (the weights training starts from,
    the first anchor) and, for every synchronisation, `sync<step>.pt` with this replica's weights just before it
    (`before`) and the weights it continues from (`after`). Read-only: the run trains as it would without it."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)

    @staticmethod
    def _weights(trainer: L.Trainer) -> dict[str, torch.Tensor]:
        return {
            name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in trainer.strategy.model.named_parameters()
        }

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        torch.save(self._weights(trainer), self.dirpath / f"rank{trainer.global_rank}_start.pt")
        strategy, synchronize = trainer.strategy, trainer.strategy.synchronize

        def recorded() -> None:
            before = self._weights(trainer)
            synchronize()
            record = {"before": before, "after": self._weights(trainer)}
            torch.save(record, self.dirpath / f"rank{trainer.global_rank}_sync{trainer.global_step}.pt")

        strategy.synchronize = recorded
