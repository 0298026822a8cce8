"""The machinery every token-stream datamodule shares: (x, y) windows over a token array, the global-batch
sampler per split, and the resume position."""

from __future__ import annotations

import glob
import hashlib
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from parallelkit.data.sampler import GlobalBatchSampler
from parallelkit.errors import DataError

T = TypeVar("T")


def cache_root(cache_dir: str | None) -> Path:
    """Where datamodules cache token streams: `cache_dir`, else `$PARALLELKIT_CACHE`, else ~/.cache/parallelkit."""
    return Path(cache_dir or os.environ.get("PARALLELKIT_CACHE") or "~/.cache/parallelkit").expanduser()


def sources_digest(files: Sequence[Path], *parts: str) -> Any:
    """A sha256 of `parts` and each file's path, size and mtime: what names a cache of `files` (a file changed, added
    or removed names another). Callers add what else changes the cache's contents."""
    digest = hashlib.sha256("\0".join(parts).encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest


def write_atomically(target: Path, write: Callable[[IO[bytes]], T]) -> T:
    """`write(out)` into a temporary file beside `target`, renamed to `target` once complete (ranks racing to build
    a cache, or a crash, never leave a partial file under the name); returns what `write` returned."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            result = write(out)
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    return result


def find_files(paths: Sequence[str], pattern: str) -> list[Path]:
    """`paths` (files, directories searched recursively for `pattern`, hidden entries left out; glob patterns) as
    files, resolved, deduplicated and sorted: the order of a datamodule's stream. An entry matching nothing is a
    DataError."""
    found: list[Path] = []
    for entry in paths:
        path = Path(entry).expanduser()
        if path.is_dir():  # hidden files and directories (.git, .DS_Store) are not the user's text
            matches = [
                p
                for p in path.rglob(pattern)
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
            ]
        elif path.is_file():
            matches = [path]
        else:
            matches = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
        if not matches:
            raise DataError(
                f"data.paths entry {entry!r} matches no file (directories are searched for {pattern!r}). Fix: point "
                "data.paths at existing files, a directory or a glob, or change data.pattern."
            )
        found.extend(matches)
    return sorted({p.resolve() for p in found})


class PositionedLoader(DataLoader):
    """A DataLoader whose resume position its datamodule keeps (`TokenStreamDataModule.state_dict`, saved with every
    checkpoint): resumable mid-epoch, so it answers Lightning's `state_dict`/`load_state_dict` (with nothing of its
    own to add), and Lightning does not warn that it is not."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        pass


class TokenWindows(Dataset):
    """Non-overlapping windows of a 1-D token array; sample ``i`` is ``(x, y)``, ``y`` = ``x`` shifted by one.

    Window ``i`` reads ``tokens[i*seq_len : i*seq_len + seq_len + 1]``; its last token is only a target,
    and is the first input of window ``i + 1``.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(len(self.tokens) - 1, 0) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        # Pickling an np.memmap copies the whole array into each spawned DataLoader worker; reopen it instead,
        # with its dtype (bytes are uint8, token ids uint16 or uint32).
        state = dict(self.__dict__)
        if isinstance(self.tokens, np.memmap):
            state["tokens"] = (self.tokens.filename, self.tokens.offset, len(self.tokens), self.tokens.dtype.str)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["tokens"], tuple):
            filename, offset, length, dtype = state["tokens"]
            state["tokens"] = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=(length,))
        self.__dict__.update(state)


class TokenStreamDataModule(L.LightningDataModule):
    """Base of parallelkit's datamodules: train/val ``TokenWindows`` fed through ``GlobalBatchSampler``.

    Subclasses fill ``self.train_set`` and ``self.val_set`` in ``setup`` and describe their source for
    error messages; this class turns them into dataloaders that keep the global sample order of every
    layout identical, and saves/restores the position in the training epoch through Lightning's
    datamodule checkpoint hooks.

    Args:
        seq_len: tokens per sample (the model's context length).
        batch_size: samples per process per step; the global batch is
            ``batch_size x data-parallel size x accumulate_grad_batches``.
        seed: seed of the training order (epoch ``e`` shuffles with ``seed + e``).
        num_workers: DataLoader worker processes per rank.
    """

    vocab_size: int = 256

    def __init__(self, seq_len: int, batch_size: int, seed: int, num_workers: int) -> None:
        super().__init__()
        if seq_len < 1:
            raise DataError(f"seq_len is {seq_len}; it must be at least 1. Fix: set data.seq_len >= 1.")
        if batch_size < 1:
            raise DataError(f"batch_size is {batch_size}; it must be at least 1. Fix: set data.batch_size >= 1.")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None
        self._train_sampler: GlobalBatchSampler | None = None
        self._resume_state: dict[str, int] | None = None
        self._launch_model: Any = None

    def describe(self, split: str) -> str:
        """Where ``split``'s tokens come from, as the subject of an error message."""
        return f"The {split} split"

    def more_data_hint(self, split: str) -> str:
        """How to give ``split`` more samples, for the fix in an error message."""
        return "use more data"

    def data_parallel_layout(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` of the data-parallel group this process reads for.

        Lightning's parallel strategies report it as ``distributed_sampler_kwargs``; a single-device
        strategy has none, and without a trainer there is one process.
        """
        strategy = getattr(self.trainer, "strategy", None)
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None)
        if not kwargs:
            return 1, 0
        return int(kwargs["num_replicas"]), int(kwargs["rank"])

    @override
    def train_dataloader(self) -> DataLoader:
        self._train_sampler = self._sampler(self.train_set, "train", shuffle=True)
        if self._resume_state:
            self._train_sampler.load_state_dict(self._resume_state)
            # Applied once: a dataloader reloaded in a later epoch must start that epoch from its beginning.
            self._resume_state = None
        return self._loader(self.train_set, self._train_sampler)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, self._sampler(self.val_set, "val", shuffle=False))

    @override
    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    @override
    def predict_dataloader(self) -> DataLoader:
        """The validation split: `parallelkit predict --config ...` works on any shipped config."""
        return self.val_dataloader()

    @override
    def state_dict(self) -> dict[str, int]:
        """The training position: epoch and global samples consumed in it (empty when not training).

        ``batch_progress.current.processed`` counts this epoch's micro-batches up to and including the
        one whose ``on_train_batch_end`` saves the checkpoint, so resuming starts at the next one.
        """
        if self.trainer is None or self._train_sampler is None:
            return {}
        processed = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {**self._train_sampler.state_dict(processed), "epoch": self.trainer.current_epoch}

    @override
    def load_state_dict(self, state_dict: Mapping[str, int]) -> None:
        """Remember the saved position; the train dataloader built next starts there."""
        self._resume_state = dict(state_dict) or None

    def model(self) -> Any:
        """The model this data feeds: the trainer's, or, before launch, the one `check_launch` was given (None
        without either)."""
        model = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        return model if model is not None else self._launch_model

    def check_launch(self, model: Any, num_replicas: int, trainer: Any) -> None:
        """Refuse, in the launching process before any rank starts, what this data cannot give the run of `model`:
        ids it has no embedding for, a split holding less than one global batch of `num_replicas` x batch_size, or
        an integer `val_check_interval` beyond an epoch's batches (a Lightning traceback otherwise). Builds the cache
        here (`prepare_data`: the ranks then read it) and sets the splits up."""
        self._launch_model = model
        self.prepare_data()
        self.setup("fit")
        validates = trainer.limit_val_batches != 0
        self._check_global_batch(self.train_set, "train", num_replicas)
        if validates:
            self._check_global_batch(self.val_set, "val", num_replicas)
        interval, limit = trainer.val_check_interval, trainer.limit_train_batches
        if not (validates and isinstance(interval, int) and trainer.check_val_every_n_epoch is not None):
            return
        global_batch = self.batch_size * num_replicas
        per_epoch = len(self.train_set) // global_batch
        batches = min(per_epoch, limit) if isinstance(limit, int) else int(per_epoch * limit)
        if interval > batches:
            raise DataError(
                f"trainer.val_check_interval={interval} batches is more than an epoch's {batches} training batches "
                f"({self.describe('train')}: {len(self.train_set)} samples of seq_len {self.seq_len} in global "
                f"batches of {global_batch}), so validation would never run. Fix: --trainer.val_check_interval="
                f"{batches} or fewer, a fraction of the epoch (e.g. 0.5), or --trainer.check_val_every_n_epoch=null "
                "to count batches across epochs."
            )

    def _check_global_batch(self, dataset: Any, split: str, num_replicas: int) -> None:
        global_batch_size = self.batch_size * num_replicas
        if len(dataset) < global_batch_size:
            raise DataError(
                f"{self.describe(split)} holds {len(dataset)} samples of seq_len {self.seq_len}, fewer than "
                f"one global batch of {global_batch_size} (batch_size {self.batch_size} x data-parallel size "
                f"{num_replicas}). Fix: {self.more_data_hint(split)}, or lower data.batch_size or "
                f"data.seq_len."
            )

    def _sampler(self, dataset: TokenWindows | None, split: str, shuffle: bool) -> GlobalBatchSampler:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before its {split} dataloader is built")
        num_replicas, rank = self.data_parallel_layout()
        self._check_global_batch(dataset, split, num_replicas)
        return GlobalBatchSampler(len(dataset), self.batch_size, num_replicas, rank, shuffle=shuffle, seed=self.seed)

    def _loader(self, dataset: TokenWindows | None, sampler: GlobalBatchSampler) -> DataLoader:
        return PositionedLoader(dataset, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers)
