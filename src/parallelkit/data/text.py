"""Byte-level language modelling over a text corpus on disk (by default the Python standard library's own
source, present on every machine). The shared windowing, sampling and resume logic is in `stream.py`."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
from typing_extensions import override

from parallelkit.data.stream import (
    TokenStreamDataModule,
    TokenWindows,
    cache_root,
    find_files,
    sources_digest,
    write_atomically,
)
from parallelkit.errors import DataError

BYTE_VOCAB = 256
"""The ids `TextDataModule` feeds: the 256 byte values."""


def default_corpus_files() -> list[Path]:
    """The standard library's top-level ``*.py`` files: several MB of text on every machine, no download."""
    return sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.is_file())


class TextDataModule(TokenStreamDataModule):
    """Byte-level language modelling (vocabulary of 256) over text files, split into train and val.

    The files are read once, in sorted path order, into a single byte stream cached under
    ``cache_dir``; the first ``1 - val_fraction`` of the stream is the training split and the rest the
    validation split, so no text is in both. Each sample is a non-overlapping window of ``seq_len``
    bytes and its next-byte targets. The training order is shuffled globally with ``seed`` and each
    data-parallel rank reads its slice of every global batch, so any layout sees the same batches.

    Bytes are the ids of a model with a vocabulary of 256 and no tokenizer of its own (`check_model`); a model
    that has one (a pretrained directory holding a tokenizer) is fed by ``TokenizedDataModule``.

    Args:
        paths: files, directories (searched recursively for ``pattern``) or glob patterns; a string or
            a list. ``None`` uses the Python standard library's top-level ``*.py`` sources.
        pattern: file-name pattern for files inside directories given in ``paths`` (default: every file).
        seq_len: bytes per sample (the model's context length).
        batch_size: samples per process per step (the micro-batch); the global batch is
            ``batch_size x data-parallel size x accumulate_grad_batches``.
        val_fraction: fraction of the byte stream, taken from its end, used for validation and test.
        seed: seed of the training order (epoch ``e`` shuffles with ``seed + e``).
        num_workers: DataLoader worker processes per rank.
        cache_dir: where the concatenated corpus is cached; default ``$PARALLELKIT_CACHE`` or
            ``~/.cache/parallelkit``.
    """

    def __init__(
        self,
        paths: str | list[str] | None = None,
        pattern: str = "*",
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        seed: int = 1234,
        num_workers: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__(seq_len=seq_len, batch_size=batch_size, seed=seed, num_workers=num_workers)
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"val_fraction is {val_fraction}; it must be in [0, 1). Fix: e.g. data.val_fraction=0.05.")
        self.paths = [paths] if isinstance(paths, str) else paths
        self.pattern = pattern
        self.val_fraction = val_fraction
        self.cache_dir = cache_dir
        self.num_bytes = 0

    def files(self) -> list[Path]:
        """The corpus files, resolved, deduplicated and sorted (the order of the byte stream)."""
        return default_corpus_files() if self.paths is None else find_files(self.paths, self.pattern)

    def corpus_path(self) -> Path:
        """The cache file for the current corpus, named by a hash of its files' paths, sizes and mtimes."""
        digest = sources_digest(self.files())
        return cache_root(self.cache_dir) / f"bytes-{digest.hexdigest()[:16]}.bin"

    def describe(self, split: str) -> str:
        source = "the standard library's *.py files" if self.paths is None else f"{self.paths}"
        return f"The {split} split of the corpus {source} ({self.num_bytes} bytes, val_fraction {self.val_fraction})"

    def more_data_hint(self, split: str) -> str:
        return "raise data.val_fraction or add text" if split == "val" else "add text to data.paths"

    @override
    def prepare_data(self) -> None:
        """Build the cached byte stream once per node (Lightning calls this on local rank 0 only)."""
        self._build_corpus()

    def check_model(self, model: Any) -> None:
        """Refuse a model whose ids are not bytes: one with a tokenizer of its own (`tokenizer_directory`, as
        `HFCausalLM(pretrained=DIR)` has when DIR holds one), or a vocabulary other than the 256 byte values. The CLI
        calls it before launch; `setup` calls it again (the Python API)."""
        name = type(model).__name__
        vocab_size = getattr(model, "vocab_size", None)
        own = getattr(model, "tokenizer_directory", None)
        if own is not None:
            raise DataError(
                f"data is TextDataModule, which feeds bytes (ids 0-255), but the model {name} comes with its own "
                f"tokenizer ({own}, {vocab_size} tokens): it would train on ids that mean other tokens to it. Fix: "
                f"--data=parallelkit.data.TokenizedDataModule --data.init_args.paths=YOUR_TEXT (it tokenizes with "
                f"the model's tokenizer)."
            )
        if isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and vocab_size != BYTE_VOCAB:
            raise DataError(
                f"data is TextDataModule, which feeds bytes (ids 0-255), but the model {name} has vocab_size "
                f"{vocab_size}, not the {BYTE_VOCAB} byte values. Fix: feed it its own tokenizer's ids "
                f"(--data=parallelkit.data.TokenizedDataModule --data.init_args.tokenizer=TOKENIZER_DIR "
                f"--data.init_args.paths=YOUR_TEXT), or build the model with vocab_size {BYTE_VOCAB}."
            )

    @override
    def setup(self, stage: str | None = None) -> None:
        model = self.model()
        if model is not None:
            self.check_model(model)
        path = self._build_corpus()
        self.num_bytes = path.stat().st_size
        if self.num_bytes == 0:
            raise DataError(
                f"The corpus {self.paths} is empty (0 bytes in {path}). Fix: point data.paths at non-empty text files."
            )
        split = int(self.num_bytes * (1.0 - self.val_fraction))
        self.train_set = TokenWindows(_open_bytes(path, 0, split), self.seq_len)
        self.val_set = TokenWindows(_open_bytes(path, split, self.num_bytes - split), self.seq_len)

    def _build_corpus(self) -> Path:
        """Write the concatenated corpus unless it is cached; atomic, since several ranks may race."""
        target = self.corpus_path()
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        files = self.files()
        write_atomically(target, lambda out: [out.write(path.read_bytes()) for path in files])
        return target


def _open_bytes(path: Path, offset: int, length: int) -> np.ndarray:
    # A memmap of its own per split (not a slice of one) keeps `offset` true for TokenWindows' pickling;
    # numpy refuses to map zero bytes, which a tiny corpus can leave in a split.
    if length == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(length,))
