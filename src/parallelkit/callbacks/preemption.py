"""Save a checkpoint when the job is told to stop (SIGTERM: preemption, SLURM, torchrun shutting down)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from parallelkit.compat import note_sigterm


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM, write `last.ckpt` where the ModelCheckpoint callback keeps its checkpoints, then let the job
    exit cleanly (exit code 0), so that a relaunch with `ckpt_path: last` continues where it stopped.

    The signal handler only notes the signal. Lightning's own handler also runs a broadcast from inside the
    handler, that is, in the middle of whatever collective the rank was in, and a 4-process job signalled that
    way hung. Noted, the flag is shared by the training loop's per-step broadcast from rank 0, and every rank
    raises `SIGTERMException` at the same step, so the save below is collective, as a sharded save must be.
    The signal must reach rank 0 (SLURM and torchrun signal every process). Every strategy parallelkit ships adds
    this callback itself: those built on `ParallelkitStrategy` (plugins' included, e.g. DiLoCo) and `ddp_comm`.
    """

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_sigterm(signum: int, frame: object) -> None:
            note_sigterm(trainer)

        # Lightning restores the previous handlers when the trainer tears down.
        signal.signal(signal.SIGTERM, on_sigterm)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            path = Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
        else:
            path = Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
        trainer.save_checkpoint(path)
