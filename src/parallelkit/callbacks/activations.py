"""Peak memory held by activations saved for backward, measured on any device (CPU included)."""

from __future__ import annotations

import weakref
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from parallelkit.compat import checkpointed_submodules, recomputing
from parallelkit.memory import SavedTensorLedger

_OPEN_WINDOWS: dict[str, Any] = {}
"""The ledger and hooks that the `SavedTensorWindow`s open now share, and how many are open."""


class SavedTensorWindow:
    """Counts what autograd saves for backward between `start()` and `stop()` (which returns the peak bytes).

    Autograd calls only the innermost saved-tensor hooks, so windows open at the same time (RankMonitor's and
    ActivationMemoryMonitor's, both around each training step) share one count, from the first one's start: a
    second set of hooks would leave the first window counting nothing.
    """

    def __init__(self) -> None:
        self._ledger: SavedTensorLedger | None = None

    def start(self, model: torch.nn.Module | None = None) -> None:
        """Open the window; with `model`, its checkpointed modules' kept inputs and recomputations count too."""
        if model is not None:
            watch_checkpointed(model)
        shared = _OPEN_WINDOWS
        if not shared:
            ledger = SavedTensorLedger()
            hooks = torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack)
            hooks.__enter__()
            shared.update(ledger=ledger, hooks=hooks, open=0)
        shared["open"] += 1
        self._ledger = shared["ledger"]

    def stop(self) -> int:
        if self._ledger is None:
            return 0
        ledger, self._ledger = self._ledger, None
        shared = _OPEN_WINDOWS
        shared["open"] -= 1
        if shared["open"] == 0:
            shared.pop("hooks").__exit__(None, None, None)
            shared.clear()
        return ledger.peak


def watch_checkpointed(model: torch.nn.Module) -> None:
    """Make an open window count what `model`'s checkpointed modules hold (once per module): their kept inputs, and
    their recomputed activations during backward. Inside a checkpointed forward, checkpoint's saved-tensor hooks,
    not the ledger's, are called."""
    if model in _LOOKED_THROUGH:  # checkpointing is applied before training starts: each model is looked through once
        return
    _LOOKED_THROUGH.add(model)
    for module in checkpointed_submodules(model):
        if module not in _WATCHED:
            _WATCHED.add(module)
            module.register_forward_pre_hook(_checkpointed_forward_starts, with_kwargs=True)
            module.register_forward_hook(_checkpointed_forward_ends, always_call=True)


_LOOKED_THROUGH: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_WATCHED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _checkpointed_forward_starts(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    ledger = _OPEN_WINDOWS.get("ledger")
    if ledger is None:
        return
    if recomputing(module):
        recomputation = ledger.recomputation()
        recomputation.__enter__()
        _RECOMPUTING[module] = recomputation
        return
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            ledger.hold_input(value)


def _checkpointed_forward_ends(module: torch.nn.Module, args: tuple, output: Any) -> None:
    recomputation = _RECOMPUTING.pop(module, None)
    if recomputation is not None:
        recomputation.__exit__(None, None, None)


_RECOMPUTING: dict[torch.nn.Module, Any] = {}


class ActivationMemoryMonitor(L.Callback):
    """Logs `activation_peak_mb`: the most memory this rank's saved activations held during each training step.

    Device-independent (it counts what autograd keeps for backward, not allocator statistics), so it shows
    on CPU what pipeline schedules do to activation memory: GPipe keeps every microbatch's activations until
    backward, 1F1B at most one per stage in flight. Each rank logs its own value (loggers write rank 0's).
    """

    def __init__(self) -> None:
        self._window = SavedTensorWindow()
        self.peak_bytes = 0
        """This rank's largest per-step peak so far (every rank keeps its own; loggers see rank 0's)."""

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._window.start(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        peak = self._window.stop()
        self.peak_bytes = max(self.peak_bytes, peak)
        pl_module.log("activation_peak_mb", peak / 2**20, on_step=True, rank_zero_only=True)
