"""Callbacks the tests name by class_path in the runs they launch (this directory is on their PYTHONPATH)."""

from __future__ import annotations

import os
import signal

import lightning as L


class SigtermAt(L.Callback):
    """Sends SIGTERM to this process once optimizer step `step` is done, on every rank: a preemption (SLURM and
    torchrun signal every process of the job) at a step the test chooses."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)
