"""Memory accounting, in one place: the bytes a tensor holds on this rank (its shard; an NF4 weight's codes and
scales), a rank's training state, what autograd saves for backward (the ledger the activation monitors and the
planner count with), an NF4 weight's stored size, and how bytes are written."""

from __future__ import annotations

import resource
import sys
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from parallelkit.adapters.nf4 import BLOCK, scaler_block_size
from parallelkit.compat import saved_tensors_hooks_in_force, storage_key, view_base


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of `t`: its local shard, and of a tensor subclass made of others (an NF4 weight: codes
    and scales) those others' bytes."""
    t = t.to_local() if isinstance(t, DTensor) else t
    if hasattr(t, "__tensor_flatten__"):
        return sum(local_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def training_state_bytes(module: torch.nn.Module, optimizers: list[Any]) -> int:
    """Bytes this rank holds of parameters, gradients and optimizer state (local shards, from storage sizes)."""
    params = list(module.parameters())
    total = sum(local_bytes(p) for p in params) + sum(local_bytes(p.grad) for p in params if p.grad is not None)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            total += sum(local_bytes(v) for v in state.values() if torch.is_tensor(v) and v.ndim > 0)
    return total


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def nbytes(x: Any) -> float:
    """Bytes of a tensor, or of the tensors in a tuple or list (nested), as allocated; 0 for anything else."""
    if isinstance(x, torch.Tensor):
        return float(x.numel() * x.element_size())
    if isinstance(x, (tuple, list)):
        return sum(nbytes(v) for v in x)
    return 0.0


def nf4_bytes(numel: int) -> int:
    """Bytes of a weight of `numel` values stored as NF4: 4-bit codes, an int8 scale per block, an fp32 scale per
    scaler block, the scales' mean and the 16-value code table (fp32)."""
    blocks = numel // BLOCK
    return numel // 2 + blocks + 4 * (blocks // max(scaler_block_size(numel), 1)) + 4 + 64


def gb(nbytes: float) -> str:
    """Bytes as people read them: GB from 0.1 GB up, MB below."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


class SavedTensorLedger:
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


class _Held:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
