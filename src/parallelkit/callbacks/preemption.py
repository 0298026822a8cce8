"""Stop a run when told to, keeping what it trained: on SIGTERM (preemption, SLURM, torchrun shutting down) and on
Ctrl-C every rank stops at the same step and saves it; Ctrl-C before training starts, or a second time, quits at once.
Rank 0 says what is saved and the command that resumes from it."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence
from os import _exit  # documented (os._exit): ends the process from any thread, whatever the main thread waits in
from pathlib import Path
from types import FrameType
from typing import NoReturn

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from parallelkit.compat import last_checkpoints, last_step_saved, note_sigterm, skip_sigterm_broadcast

INTERRUPTED = 128 + signal.SIGINT
"""The exit status of a run stopped by Ctrl-C (130: what a shell reports for a process SIGINT ended)."""

SAME_PRESS_S = 1.0
"""SIGINTs closer together than this are one Ctrl-C: a terminal signals every process of the job, and torchrun
forwards the SIGINT it got to its workers as well."""

QUIT_AFTER_S = 2.0
"""How long Ctrl-C before training started leaves the main thread to end the process (cleaning up what it was
writing) before the process ends anyway: a main thread waiting in C++ (a rendezvous, a collective) never sees it."""

RANK_ZERO_GRACE_S = 10.0
"""How long an interrupted rank other than 0 waits for rank 0 to end before ending itself: rank 0 speaks for the job,
and a launcher that sees another rank fail first ends rank 0 before it has (Lightning's launcher does, SIGKILL)."""


class Interrupted(SystemExit):
    """Ctrl-C before training started: the process ends with INTERRUPTED, nothing having been trained or saved."""


class CtrlC:
    """What Ctrl-C (SIGINT) does to a parallelkit run, in every process of it (a terminal signals them all).

    Python turns SIGINT into KeyboardInterrupt wherever the main thread is, and not at all while it waits in C++: a
    job interrupted as its ranks started printed a traceback per rank, a rank waiting in the rendezvous never
    stopped (Lightning's launcher SIGKILLed it: exit 137), and one interrupted mid-training lost every step since its
    last checkpoint, leaving collectives in flight. Once `arm`ed, the signal is watched by a thread of its own (the
    interpreter's wakeup fd), which acts whatever the main thread waits in:

    - Before training starts nothing is trained or saved, so the process ends at once with INTERRUPTED: rank 0 says
      so in one line (`before`) and ends the ranks its launcher started; the other ranks say nothing and end once
      rank 0 has. The main thread ends it (`Interrupted`, unwinding what it was writing) unless it is waiting in C++
      or a process group exists (nothing then to clean up, and no C++ teardown to warn about collectives in flight),
      where the process ends without unwinding.
    - During training (`training`, from `PreemptionCheckpoint.on_train_start`) the first Ctrl-C is only noted
      (`pressed`): `PreemptionCheckpoint` stops every rank at the same step and saves it, and `InterruptNotice` says
      how to resume. A second one quits at once, without saving: a checkpoint being written stays `.partial`, which
      nothing reads.

    The parallelkit CLI arms it for fit/validate/test/predict; with a strategy that has no `PreemptionCheckpoint`
    (Lightning's own) it is disarmed as training starts, and Ctrl-C is Lightning's KeyboardInterrupt again.
    """

    def __init__(self) -> None:
        self.armed_in: int | None = None  # the process it is armed in (a forked child is not)
        self.training = False
        self.pressed = False
        self.before = ""
        self.trainer: L.Trainer | None = None  # the run's, once built: its launcher's ranks are ended with rank 0
        self._first_press: float | None = None
        self._launcher_pid = 0
        self._wakeup: tuple[int, int] | None = None
        self._previous_wakeup = -1
        self._said = False
        self._raised = False
        self._lock = threading.Lock()

    def arm(self, before: str) -> None:
        """Watch SIGINT in this process from now on; `before`: rank 0's line for Ctrl-C before training starts."""
        if self.armed_in == os.getpid() or threading.current_thread() is not threading.main_thread():
            return
        read, write = os.pipe()
        os.set_blocking(write, False)
        self.armed_in, self.before, self._launcher_pid = os.getpid(), before, os.getppid()
        self.training = self.pressed = self._said = self._raised = False
        self._first_press, self._wakeup = None, (read, write)
        signal.signal(signal.SIGINT, self.on_sigint)
        self._previous_wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read,), name="parallelkit-ctrl-c", daemon=True).start()

    def disarm(self) -> None:
        """Ctrl-C is Python's KeyboardInterrupt again in this process."""
        if self.armed_in != os.getpid() or threading.current_thread() is not threading.main_thread():
            return
        self.armed_in = None
        signal.set_wakeup_fd(self._previous_wakeup)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if self._wakeup is not None:
            os.close(self._wakeup[1])  # the watching thread reads the end of the pipe and ends
            self._wakeup = None

    def forked(self) -> None:
        """In a child forked from an armed process without exec (a DataLoader worker): Ctrl-C is the parent's to
        handle, and a worker that ended on it would fail the step being saved."""
        if self.armed_in is None or self.armed_in == os.getpid():
            return
        self.armed_in = None
        with contextlib.suppress(ValueError):  # forked from another thread: signals are not this one's to set
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_sigint(self, signum: int, frame: FrameType | None) -> None:
        """The SIGINT handler the main thread runs (when it runs Python): during training the watching thread has
        noted the signal; before, the process ends."""
        if self.armed_in != os.getpid():
            signal.default_int_handler(signum, frame)
        if self.training or self._raised:
            return
        if dist.is_available() and dist.is_initialized():
            self.quit(self.before)
        self._raised = True
        self.say(self.before, last=True)
        self.end_launched_ranks()
        raise Interrupted(INTERRUPTED)

    def _watch(self, read: int) -> None:
        with os.fdopen(read, "rb", buffering=0) as wakeups:
            while signals := wakeups.read(512):  # empty once `disarm` closed the other end
                if signal.SIGINT in signals:
                    self._press()

    def _press(self) -> None:
        now = time.monotonic()
        first = self._first_press is None
        if not first and now - self._first_press < SAME_PRESS_S:
            return
        self._first_press = self._first_press or now
        if not self.training:
            time.sleep(QUIT_AFTER_S)  # the main thread ends the process first unless it waits in C++
            self.quit(self.before)
        if first:
            self.pressed = True
            self.say(
                "parallelkit: Ctrl-C: every rank stops after the step it is training, which is saved; Ctrl-C again "
                "quits at once without saving."
            )
        else:
            self.quit(
                "parallelkit: Ctrl-C again: quit without saving the step being trained (a checkpoint being written "
                "stays `.partial`, which is never read)."
            )

    def say(self, line: str, last: bool = False) -> None:
        """Print `line` on stderr, on rank 0 only; `last`: the line the process ends with, said once (by whichever
        of the main thread and the watching thread ends it first)."""
        with self._lock:
            if rank() != 0 or self._said:
                return
            self._said = last
        print(line, file=sys.stderr, flush=True)

    def end_launched_ranks(self) -> None:
        """SIGKILL the ranks this process's launcher started (none but in rank 0 under Lightning's launcher), as
        Lightning's own KeyboardInterrupt handling does: a rank left alone would wait for this one."""
        launcher = getattr(getattr(self.trainer, "strategy", None), "launcher", None)
        if launcher is not None:
            launcher.kill(signal.SIGKILL)

    def wait_for_rank_zero(self) -> None:
        """On a rank other than 0, interrupted: wait (at most RANK_ZERO_GRACE_S) for rank 0 to end, which is seen as
        this process's parent ending when rank 0 launched it. Elsewhere (torchrun, the test suite's launcher) the
        launcher ends this rank once rank 0 has ended."""
        deadline = time.monotonic() + RANK_ZERO_GRACE_S
        while rank() and os.getppid() == self._launcher_pid and time.monotonic() < deadline:
            time.sleep(0.05)

    def quit(self, line: str) -> NoReturn:
        """End the process now, from any thread, with INTERRUPTED: rank 0 after saying `line` and ending the ranks
        it launched, another rank once rank 0 has ended. Nothing is unwound: no `finally`, no C++ teardown."""
        self.say(line, last=True)
        if rank() == 0:
            self.end_launched_ranks()
        else:
            self.wait_for_rank_zero()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        _exit(INTERRUPTED)


CTRL_C = CtrlC()
"""Ctrl-C in this process (see `CtrlC`)."""

os.register_at_fork(after_in_child=CTRL_C.forked)


def rank() -> int:
    """This process's global rank as Lightning knows it (from the launcher's variables until the strategy sets it)."""
    return getattr(rank_zero_only, "rank", 0) or 0


SIGTERM_STOP, CTRL_C_STOP = 1, 2
"""What a rank noted, as the flag the ranks all-reduce (max): a Ctrl-C anywhere makes the whole job's stop one."""


class PreemptionCheckpoint(L.Callback):
    """On SIGTERM, write `last.ckpt` where the ModelCheckpoint callback keeps its checkpoints, then let the job
    exit cleanly (exit code 0), so that a relaunch with `ckpt_path: last` continues where it stopped. Ctrl-C in the
    parallelkit CLI (`CtrlC`) stops and saves the same way, then exits with INTERRUPTED (130) once `InterruptNotice`
    has said how to resume.

    The signal handler only notes the signal, on the callback. Lightning's own handler runs a broadcast from
    inside the handler, that is, in the middle of whatever collective the rank was in, and a 4-process job
    signalled that way hung. Lightning's loop also raises `SIGTERMException` at the end of a step on any rank that
    has the flag, whether or not the others have it yet: a signal that reaches rank 0 just after rank 1 finished
    that check sent rank 0 into the save while rank 1 went on to the next step's broadcast, and the job hung
    (seen under `ddp_comm` on a loaded 2-core machine). So the ranks agree first: at the end of every batch they
    all-reduce the noted flag (max, one integer: SIGTERM_STOP or CTRL_C_STOP), without waiting for it: the result is
    read at the end of the next batch, and only then is the flag raised in the trainer, on every rank at once; every
    rank raises `SIGTERMException` at the same step (the one after the signal), and the save below is collective, as
    a sharded save must be. A signal that reaches any one rank stops the job. Since every rank raises the flag
    itself, the loop's own broadcast of rank 0's flag before each step (a blocking collective) is left out. Every
    strategy parallelkit ships adds this callback itself: those built on `ParallelkitStrategy` (plugins' included,
    e.g. DiLoCo) and `ddp_comm`.
    """

    def __init__(self) -> None:
        self.signalled = False
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        self._stop = 0

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pending, self._stop = None, 0
        if threading.current_thread() is not threading.main_thread():
            return

        def on_sigterm(signum: int, frame: object) -> None:
            self.signalled = True

        # Lightning restores the previous handlers when the trainer tears down.
        signal.signal(signal.SIGTERM, on_sigterm)
        CTRL_C.training = True
        if self._distributed(trainer):
            skip_sigterm_broadcast(trainer)

    @staticmethod
    def _distributed(trainer: L.Trainer) -> bool:
        return trainer.world_size > 1 and dist.is_initialized()

    def _noted(self) -> int:
        return CTRL_C_STOP if CTRL_C.pressed else SIGTERM_STOP if self.signalled else 0

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: object, batch: object, batch_idx: int
    ) -> None:
        if not self._distributed(trainer):
            self._stop = self._noted()
            if self._stop:
                note_sigterm(trainer)  # Lightning's loop raises SIGTERMException at the end of this step
            return
        self._stop = self._agreed()
        if self._stop:
            note_sigterm(trainer)
            return
        flag = torch.tensor([self._noted()], device=trainer.strategy.root_device)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)

    def _agreed(self) -> int:
        """What any rank had noted at the end of the previous batch, the strongest (waits for that all-reduce)."""
        if self._pending is None:
            return 0
        work, flag = self._pending
        self._pending = None
        work.wait()
        return int(flag.item())

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
        trainer.save_checkpoint(path, weights_only=False)
        if self._stop != CTRL_C_STOP:
            return
        exception.code = INTERRUPTED  # Lightning raises it on once the trainer is torn down
        notice = next((c for c in trainer.callbacks if isinstance(c, InterruptNotice)), None)
        if notice is not None:
            notice.report(trainer, saved=path)
        else:
            CTRL_C.say(f"Interrupted at step {trainer.global_step}, which is saved: {path}", last=True)


class InterruptNotice(L.Callback):
    """On Ctrl-C, rank 0 says what is saved and the command that resumes from it: `argv` (the `parallelkit`
    command's arguments) with `--ckpt_path last` when the newest checkpoint is what `last` finds, else with its path.
    Under a parallelkit strategy that is the step being trained, which `PreemptionCheckpoint` saved; under
    Lightning's own strategies (Ctrl-C is Lightning's KeyboardInterrupt there) the newest checkpoint saved before. A
    checkpoint interrupted while being written (`.partial`) is named as incomplete: nothing reads it. The parallelkit
    CLI adds this callback to every run."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not any(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks):
            CTRL_C.disarm()  # nothing would save the step: Lightning's own handling, and the notice below

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, KeyboardInterrupt):
            self.report(trainer)

    def report(self, trainer: L.Trainer, saved: Path | None = None) -> None:
        """Say, on rank 0, what is saved and how to resume; `saved`: the checkpoint of the step interrupted."""
        if trainer.global_rank != 0:
            return
        found, partial, lasts, step = [], [], set(), 0
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath and Path(callback.dirpath).is_dir():
                entries = list(Path(callback.dirpath).iterdir())
                found += [p for p in entries if p.suffix == callback.FILE_EXTENSION]
                partial += [p for p in entries if p.name.endswith(".partial")]
                lasts |= {Path(p).resolve() for p in last_checkpoints(callback, trainer)}
                step = max(step, last_step_saved(callback))
        if saved is not None:
            said = f"Interrupted at step {trainer.global_step}, which is saved: {saved};"
            newest = saved
        elif found:
            newest = max(found, key=lambda path: path.stat().st_mtime)
            said = f"Interrupted at step {trainer.global_step}. The newest checkpoint is {newest}"
            said += (f" (step {step})" if step else "") + ";"
        else:
            newest = None
            said = f"Interrupted at step {trainer.global_step}. No checkpoint was saved in this run: a rerun starts "
            said += "where this one started."
        if newest is not None:
            args = [  # the command as given, less a --ckpt_path (and its value)
                arg
                for i, arg in enumerate(self.argv)
                if not arg.startswith("--ckpt_path") and not (i and self.argv[i - 1] == "--ckpt_path")
            ]
            target = "last" if newest.resolve() in lasts else newest
            said += f" resume from it with: {shlex.join(['parallelkit', *args, f'--ckpt_path={target}'])}"
        if partial:
            said += f" {', '.join(p.name for p in partial)}: interrupted while being written, incomplete, not read."
        CTRL_C.say(said, last=True)
