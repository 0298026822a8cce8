"""What crosses the wire: every collective per optimizer step, by kind, with its count, bytes and time."""

from __future__ import annotations

import sys
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from parallelkit.compat import dispatch_mode_class

TorchDispatchMode = dispatch_mode_class()

KINDS = {
    "allgather": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "alltoall": "all_to_all",
    "all_to_all": "all_to_all",
    "broadcast": "broadcast",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
    "gather": "gather",  # after all_gather's names: `parallelkit.Muon` sends each matrix's shards to its owner
    "scatter": "scatter",  # after reduce_scatter's: and the owner's result back
}
"""Substrings of c10d / functional-collective op names -> the kind they are counted under."""


def _kind(op_name: str) -> str | None:
    return next((kind for key, kind in KINDS.items() if key in op_name), None)


def _payload_bytes(args: Any) -> int:
    """Logical size of a collective: its largest tensor argument (a list counts as the sum of its tensors),
    i.e. the unsharded side: all_gather's output, reduce_scatter's input, the tensor of the others."""

    def size(value: Any) -> int:
        if isinstance(value, torch.Tensor):
            return value.numel() * value.element_size()
        if isinstance(value, (list, tuple)):
            return sum(size(v) for v in value)
        return 0

    return max((size(a) for a in args), default=0)


def _group_ranks(args: Any) -> tuple[int, ...] | None:
    """The global ranks of the process group a c10d op was given (a ProcessGroup, or a functional collective's group
    name), or None when none is recognisable."""
    import torch.distributed as dist

    from parallelkit.compat import process_group_named

    for arg in args:
        try:
            if isinstance(arg, torch.ScriptObject):  # how c10d ops carry their group through the dispatcher
                arg = dist.ProcessGroup.unbox(arg)
            if isinstance(arg, dist.ProcessGroup):
                return tuple(dist.get_process_group_ranks(arg))
            if isinstance(arg, str):
                return tuple(dist.get_process_group_ranks(process_group_named(arg)))
        except (RuntimeError, ValueError, KeyError, TypeError):
            continue
    return None


@dataclass
class Call:
    """One collective as the recorder saw it: `done` stays False for a call that never returned."""

    step: int
    kind: str
    ranks: tuple[int, ...] | None
    nbytes: int
    done: bool = False

    def __str__(self) -> str:
        group = f" over ranks {','.join(map(str, self.ranks))}" if self.ranks else ""
        state = "" if self.done else "  <- never returned: the call that timed out"
        return f"step {self.step}: {self.kind}{group}, {self.nbytes / 2**20:.3f} MiB{state}"


class _CollectiveCounter(TorchDispatchMode):
    """Sees every c10d and functional-collective op dispatched while active (FSDP2, DTensor, pipelining, DDP); the
    last calls go into `recent` (a bounded deque the monitor keeps across steps)."""

    def __init__(self, recent: deque[Call] | None = None, step: int = 0) -> None:
        super().__init__()
        self.totals: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])  # count, bytes, seconds
        self.recent = recent if recent is not None else deque(maxlen=RECENT_CALLS)
        self.step = step

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace not in ("c10d", "_c10d_functional"):
            return func(*args, **(kwargs or {}))
        kind = _kind(str(func))
        call = None
        if kind is not None or "wait_tensor" in str(func):  # a functional collective's result, waited for
            call = Call(self.step, kind or "wait for the previous", _group_ranks(args), _payload_bytes(args))
            self.recent.append(call)
        begin = time.perf_counter()
        result = func(*args, **(kwargs or {}))
        if call is not None:
            call.done = True
        if kind is not None:
            entry = self.totals[kind]
            entry[0] += 1
            entry[1] += call.nbytes
            entry[2] += time.perf_counter() - begin
        return result


RECENT_CALLS = 16
"""How many of its last collectives a rank prints when one times out."""

TIMEOUT_MARKERS = ("timed out", "timeout", "watchdog")
"""Words of an exception's message that make it a collective timeout (gloo: "Timed out waiting ...ms", NCCL's
watchdog: "Watchdog caught collective operation timeout")."""


def is_timeout(exception: BaseException) -> bool:
    text = str(exception).lower()
    return any(marker in text for marker in TIMEOUT_MARKERS)


class CommunicationMonitor(L.Callback):
    """Logs, per optimizer step and per collective kind (all_gather, reduce_scatter, all_reduce, all_to_all,
    broadcast, send, recv): `comm/<kind>_count`, `comm/<kind>_bytes` and `comm/<kind>_s`, through the
    trainer's loggers, and prints a summary table on rank 0 at the end of fit.

    Bytes are the logical size of each collective on this rank (the unsharded side: all_gather's output,
    reduce_scatter's input). Time is host time in the collective calls: for asynchronous collectives (FSDP2 on
    GPUs) that is the launch, not the transfer. Enabled by `profile_communication: true` on any parallelkit
    strategy, or added as a callback with any strategy.

    It also keeps each rank's last `RECENT_CALLS` collectives (step, kind, group, size, whether it returned): when a
    collective times out (the strategy's `timeout`), every rank prints them, so the rank that stopped and the call
    the others wait in are visible. On NCCL, torch's own flight recorder dumps its trace as well
    (`TORCH_NCCL_TRACE_BUFFER_SIZE`, `TORCH_NCCL_DUMP_ON_TIMEOUT`, which parallelkit strategies set when unset).
    """

    def __init__(self) -> None:
        self._counter: _CollectiveCounter | None = None
        self._window: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        self._all: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        self._steps = 0
        self._step_before = 0
        self.recent: deque[Call] = deque(maxlen=RECENT_CALLS)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_before = trainer.global_step
        self._counter = _CollectiveCounter(self.recent, trainer.global_step)
        self._counter.__enter__()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._stop(self._window)
        if trainer.global_step == self._step_before:
            return  # an accumulation micro-step: its traffic joins the optimizer step that ends the window
        self._steps += 1
        for kind, (count, nbytes, seconds) in sorted(self._window.items()):
            pl_module.log(f"comm/{kind}_count", float(count), on_step=True, rank_zero_only=True)
            pl_module.log(f"comm/{kind}_bytes", float(nbytes), on_step=True, rank_zero_only=True)
            pl_module.log(f"comm/{kind}_s", seconds, on_step=True, rank_zero_only=True)
            totals = self._all[kind]
            for i, value in enumerate((count, nbytes, seconds)):
                totals[i] += value
        self._window.clear()

    def _stop(self, into: dict[str, list[float]]) -> None:
        if self._counter is None:
            return
        self._counter.__exit__(None, None, None)
        for kind, values in self._counter.totals.items():
            for i, value in enumerate(values):
                into[kind][i] += value
        self._counter = None

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """On a collective timeout, print this rank's last collectives (oldest first) on stderr: across the ranks'
        printouts, the rank that never reached the call the others are stuck in, and that call, stand out."""
        self._stop(self._window)
        if is_timeout(exception) and self.recent:
            lines = "\n".join(f"  {call}" for call in self.recent)
            print(
                f"parallelkit: rank {trainer.global_rank}: a collective timed out ({_first_line(exception)}); the "
                f"last {len(self.recent)} collectives this rank called, oldest first (an asynchronous one, as FSDP's, "
                f"returns at once and is waited for later); a rank that printed no such list is the one the others "
                f"wait for:\n{lines}",
                file=sys.stderr,
                flush=True,
            )

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank != 0 or not self._steps:
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"communication per optimizer step, rank 0 (mean of {self._steps} steps)")
        for column in ("collective", "count", "MB", "ms"):
            table.add_column(column, justify="right")
        for kind, (count, nbytes, seconds) in sorted(self._all.items()):
            n = self._steps
            table.add_row(kind, f"{count / n:.1f}", f"{nbytes / n / 2**20:.3f}", f"{1000 * seconds / n:.2f}")
        Console().print(table)


def _first_line(exception: BaseException) -> str:
    lines = str(exception).strip().splitlines()
    return lines[0][:200] if lines else type(exception).__name__
