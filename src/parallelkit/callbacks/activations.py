"""Peak memory held by activations saved for backward, measured on any device (CPU included)."""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from parallelkit.compat import (
    checkpointed_submodules,
    recomputing,
    saved_tensors_hooks_in_force,
    storage_key,
    view_base,
)


class _SavedTensorLedger:
    """Counts bytes of distinct storages that autograd holds for backward, and their peak.

    Parameters (leaf tensors that require grad) and views of them are left out: they live whether or not a step
    is in flight.
    A storage saved twice (a weight used by many microbatches, a view of an activation) counts once.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: Counter[tuple[int, int]] = Counter()

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple[int, int] | None:
        """The storage counted for `tensor`; None for a parameter, a view of one (a matmul saves `weight.t()`), or a
        wrapper subclass without storage of its own."""
        base = view_base(tensor)
        if base.is_leaf and base.requires_grad:
            return None
        try:
            return storage_key(tensor)  # a DTensor's local shard; meta tensors (the planner's) included
        except RuntimeError:
            return None

    def _hold(self, key: tuple[int, int], owner: object) -> None:
        """Count `key` until `owner` is freed."""
        if self._refs[key] == 0:
            self.live += key[1]
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        weakref.finalize(owner, self._release, key)

    def pack(self, tensor: torch.Tensor) -> Any:
        key = self._key(tensor)
        if key is None:
            return tensor
        holder = _Held(tensor)
        self._hold(key, holder)
        return holder

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed

    def hold_input(self, tensor: torch.Tensor) -> None:
        """Count `tensor` for as long as it lives: the input a checkpointed module keeps to recompute from."""
        key = self._key(tensor)
        if key is not None:
            self._hold(key, tensor)

    @contextmanager
    def recomputation(self) -> Iterator[None]:
        """Count what a checkpointed module's recomputation in backward saves. Checkpoint's own saved-tensor hooks
        keep those tensors (the ledger's, further out, are not called), so they are passed on to it, and counted at
        once at the end: all of them are alive then, until the module's backward consumes them."""
        inner = saved_tensors_hooks_in_force()
        if inner is None:
            yield
            return
        pack, unpack = inner
        recomputed: dict[tuple[int, int], None] = {}

        def counted(tensor: torch.Tensor) -> Any:
            key = self._key(tensor)
            if key is not None and not self._refs[key]:
                recomputed[key] = None
            return pack(tensor)

        with torch.autograd.graph.saved_tensors_hooks(counted, unpack):
            yield
        self.peak = max(self.peak, self.live + sum(size for _, size in recomputed))

    def _release(self, key: tuple[int, int]) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= key[1]


_OPEN_WINDOWS: dict[str, Any] = {}
"""The ledger and hooks that the `SavedTensorWindow`s open now share, and how many are open."""


class SavedTensorWindow:
    """Counts what autograd saves for backward between `start()` and `stop()` (which returns the peak bytes).

    Autograd calls only the innermost saved-tensor hooks, so windows open at the same time (RankMonitor's and
    ActivationMemoryMonitor's, both around each training step) share one count, from the first one's start: a
    second set of hooks would leave the first window counting nothing.
    """

    def __init__(self) -> None:
        self._ledger: _SavedTensorLedger | None = None

    def start(self, model: torch.nn.Module | None = None) -> None:
        """Open the window; with `model`, its checkpointed modules' kept inputs and recomputations count too."""
        if model is not None:
            watch_checkpointed(model)
        shared = _OPEN_WINDOWS
        if not shared:
            ledger = _SavedTensorLedger()
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


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


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
