"""Save a checkpoint when the job is told to stop (SIGTERM: preemption, SLURM, torchrun shutting down); say how to
resume when it is stopped by hand (Ctrl-C)."""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from parallelkit.compat import last_checkpoints, last_step_saved, note_sigterm, skip_sigterm_broadcast


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM, write `last.ckpt` where the ModelCheckpoint callback keeps its checkpoints, then let the job
    exit cleanly (exit code 0), so that a relaunch with `ckpt_path: last` continues where it stopped.

    The signal handler only notes the signal, on the callback. Lightning's own handler runs a broadcast from
    inside the handler, that is, in the middle of whatever collective the rank was in, and a 4-process job
    signalled that way hung. Lightning's loop also raises `SIGTERMException` at the end of a step on any rank that
    has the flag, whether or not the others have it yet: a signal that reaches rank 0 just after rank 1 finished
    that check sent rank 0 into the save while rank 1 went on to the next step's broadcast, and the job hung
    (seen under `ddp_comm` on a loaded 2-core machine). So the ranks agree first: at the end of every batch they
    all-reduce the noted flag (max, one integer), without waiting for it: the result is read at the end of the next
    batch, and only then is the flag raised in the trainer, on every rank at once; every rank raises
    `SIGTERMException` at the same step (the one after the signal), and the save below is collective, as a sharded
    save must be. A signal that reaches any one rank stops the job. Since every rank raises the flag itself, the
    loop's own broadcast of rank 0's flag before each step (a blocking collective) is left out. Every strategy
    parallelkit ships adds this callback itself: those built on `ParallelkitStrategy` (plugins' included, e.g.
    DiLoCo) and `ddp_comm`.
    """

    def __init__(self) -> None:
        self.signalled = False
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pending = None
        if threading.current_thread() is not threading.main_thread():
            return

        def on_sigterm(signum: int, frame: object) -> None:
            self.signalled = True

        # Lightning restores the previous handlers when the trainer tears down.
        signal.signal(signal.SIGTERM, on_sigterm)
        if self._distributed(trainer):
            skip_sigterm_broadcast(trainer)

    @staticmethod
    def _distributed(trainer: L.Trainer) -> bool:
        return trainer.world_size > 1 and dist.is_initialized()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        if not self._distributed(trainer):
            if self.signalled:
                note_sigterm(trainer)  # Lightning's loop raises SIGTERMException at the end of this step
            return
        if self._agreed():
            note_sigterm(trainer)
            return
        flag = torch.tensor([int(self.signalled)], device=trainer.strategy.root_device)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)

    def _agreed(self) -> bool:
        """Whether any rank had noted the signal at the end of the previous batch (waits for that all-reduce)."""
        if self._pending is None:
            return False
        work, flag = self._pending
        self._pending = None
        work.wait()
        return bool(flag.item())

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._agreed()  # no collective left in flight; a signal during the last step finds the run complete

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


class InterruptNotice(L.Callback):
    """On Ctrl-C (KeyboardInterrupt), rank 0 says what is saved and the command that resumes from it: `argv` (the
    `parallelkit` command's arguments) with `--ckpt_path last` when a `last` checkpoint exists, else the newest
    checkpoint's path. A checkpoint interrupted while being written (`.partial`) is named as incomplete: nothing
    reads it. The parallelkit CLI adds this callback to every run."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, KeyboardInterrupt) or trainer.global_rank != 0:
            return
        saved, partial, last, step = [], [], False, 0
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath and Path(callback.dirpath).is_dir():
                entries = list(Path(callback.dirpath).iterdir())
                saved += [p for p in entries if p.suffix == callback.FILE_EXTENSION]
                partial += [p for p in entries if p.name.endswith(".partial")]
                last = last or bool(last_checkpoints(callback, trainer))
                step = max(step, last_step_saved(callback))
        said = f"Interrupted at step {trainer.global_step}."
        if saved:
            newest = max(saved, key=lambda path: path.stat().st_mtime)
            said += f" The newest checkpoint is {newest}" + (f" (step {step})" if step else "") + ";"
            args = [  # the command as given, less a --ckpt_path (and its value)
                arg
                for i, arg in enumerate(self.argv)
                if not arg.startswith("--ckpt_path") and not (i and self.argv[i - 1] == "--ckpt_path")
            ]
            resume = shlex.join(["parallelkit", *args, f"--ckpt_path={'last' if last else newest}"])
            said += f" resume from it with: {resume}"
        else:
            said += " No checkpoint was saved in this run: a rerun starts where this one started."
        if partial:
            said += f" {', '.join(p.name for p in partial)}: interrupted while being written, incomplete, not read."
        print(said, file=sys.stderr, flush=True)
