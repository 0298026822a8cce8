"""Language modelling over real tokenized text: a Hugging Face tokenizer (a local ``tokenizer.json``) applied to
text and JSONL files, and token arrays other tools already wrote (nanoGPT's ``.bin``, numpy's ``.npy``).

The corpus is tokenized once, into a cache file every rank memory-maps: no rank holds the corpus in memory, and
a relaunch, or another run with the same files and tokenizer, reuses it. The windowing, the global sample order
of every layout and the resume position are those of every parallelkit datamodule (`stream.py`). `tokenizers` is
part of the optional extra ``[hf]``, imported only when a tokenizer is used; nothing is downloaded.

This module holds the datamodule: its sources, tokenizer and EOS id, and when the cache is built; the cache's
files (token arrays, the writer, reading it back) live in `token_files.py`, the windowing and sampling it shares with
the other datamodules in `stream.py` and `sampler.py`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
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
from parallelkit.data.text import default_corpus_files
from parallelkit.data.token_files import (
    CACHE_FORMAT,
    PRETOKENIZED,
    _CacheWriter,
    _open_tokens,
    _read_meta,
    max_token_id,
    min_token_id,
    open_pretokenized,
)
from parallelkit.errors import DataError


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as err:
        raise DataError(
            "data.tokenizer needs the tokenizers package, which is not installed. "
            'Fix: pip install -e ".[hf]" (or pip install "parallelkit[hf]"), or give pre-tokenized .bin/.npy files.'
        ) from err
    return tokenizers


class TokenizedDataModule(TokenStreamDataModule):
    """Language modelling over tokenized text and token arrays, split into train and val.

    The sources are read in sorted path order into one token stream: a text file (``.txt``, ``.md``, any
    suffix but those below) is one document; a ``.jsonl`` file holds one document per line, in its
    ``text_field``; ``.bin`` (raw uint16, as nanoGPT writes ``train.bin``) and ``.npy`` (a 1-D integer array)
    files are token ids taken as they are, since they already separate their documents. Each document is
    encoded by the tokenizer and followed by the EOS id, so the model sees where one ends and the next
    begins (empty documents and blank JSONL lines are left out). The stream is written once to a cache file
    under ``cache_dir`` (uint16 when the vocabulary fits, else uint32) that every rank memory-maps; a single
    ``.bin``/``.npy`` file is mapped where it is, without a copy. The first ``1 - val_fraction`` of the stream
    trains and the rest validates; samples, the global order for every data-parallel layout and the resume
    position are those of ``TextDataModule``.

    The EOS id is ``eos_id`` if set, else ``eos_token`` looked up in the tokenizer, else the ``eos_token`` the
    tokenizer directory's ``tokenizer_config.json`` names (as transformers saves it); text is not tokenized
    without one, since documents run into each other otherwise.

    ``vocab_size`` (after ``setup``) is the tokenizer's vocabulary, or for token arrays without a tokenizer
    the largest id + 1. When a trainer's model has an int ``vocab_size``, ``setup`` refuses data holding an
    id at or beyond it, rather than letting the embedding lookup fail in the middle of a step.

    Args:
        paths: files, directories (searched recursively for ``pattern``) or glob patterns; a string or a list.
            ``None`` uses the Python standard library's top-level ``*.py`` sources (text on every machine).
        tokenizer: a local directory holding a Hugging Face ``tokenizer.json`` (and, optionally,
            ``tokenizer_config.json`` naming ``eos_token``); needed for text and JSONL, not for token arrays.
            Default: the model's own, when it came from a directory that holds one (``HFCausalLM(pretrained=)``).
        seq_len: tokens per sample (the model's context length).
        batch_size: samples per process per step (the micro-batch); the global batch is
            ``batch_size x data-parallel size x accumulate_grad_batches``.
        val_fraction: fraction of the token stream, taken from its end, used for validation and test.
        seed: seed of the training order (epoch ``e`` shuffles with ``seed + e``).
        num_workers: DataLoader worker processes per rank.
        cache_dir: where the token stream is cached; default ``$PARALLELKIT_CACHE`` or ``~/.cache/parallelkit``.
        pattern: file-name pattern for files inside directories given in ``paths``.
        text_field: the field of each JSONL line that holds its document.
        eos_token: the token appended to each document, looked up in the tokenizer's vocabulary.
        eos_id: the id appended to each document.
    """

    def __init__(
        self,
        paths: str | list[str] | None = None,
        tokenizer: str | None = None,
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        seed: int = 1234,
        num_workers: int = 0,
        cache_dir: str | None = None,
        pattern: str = "*",
        text_field: str = "text",
        eos_token: str | None = None,
        eos_id: int | None = None,
    ) -> None:
        super().__init__(seq_len=seq_len, batch_size=batch_size, seed=seed, num_workers=num_workers)
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"val_fraction is {val_fraction}; it must be in [0, 1). Fix: e.g. data.val_fraction=0.05.")
        if eos_id is not None and eos_id < 0:
            raise DataError(
                f"eos_id is {eos_id}; token ids are never negative. Fix: set data.eos_id >= 0, or unset it."
            )
        self.paths = [paths] if isinstance(paths, str) else None if paths is None else list(paths)
        self.tokenizer = tokenizer
        self.val_fraction = val_fraction
        self.cache_dir = cache_dir
        self.pattern = pattern
        self.text_field = text_field
        self.eos_token = eos_token
        self.eos_id = eos_id
        self._requested_eos_id = eos_id  # `eos_id` becomes the id in use at setup; the cache is named by the request
        self.num_tokens = 0
        self.token_file: Path | None = None
        self._loaded_tokenizer: Any = None

    def files(self) -> list[Path]:
        """The source files, resolved, deduplicated and sorted (the order of the token stream)."""
        return default_corpus_files() if self.paths is None else find_files(self.paths, self.pattern)

    def tokenizer_directory(self) -> Path | None:
        """`tokenizer`, else the model's own (`tokenizer_directory` of the trainer's model: an `HFCausalLM` loaded
        from a directory that holds one), else None."""
        if self.tokenizer is not None:
            return Path(self.tokenizer).expanduser()
        model = self.model()
        directory = getattr(model, "tokenizer_directory", None)
        return Path(directory) if directory is not None else None

    def tokenizer_file(self) -> Path | None:
        """The ``tokenizer.json`` of ``tokenizer`` (None without a tokenizer)."""
        directory = self.tokenizer_directory()
        if directory is None:
            return None
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise DataError(
                f"data.tokenizer {str(directory)!r} is not a directory holding tokenizer.json (looked for {path}). "
                f"Fix: point data.tokenizer at the directory a Hugging Face tokenizer was saved to "
                f"(tokenizer.save_pretrained(DIR), or Tokenizer.save('DIR/tokenizer.json'))."
            )
        return path

    def cache_path(self) -> Path:
        """The cache's description (``.json``; the tokens are the ``.bin`` beside it), named by a hash of the
        sources' paths, sizes and mtimes, the tokenizer file's contents and the options that change the tokens."""
        digest = sources_digest(self.files(), f"tokenized-{CACHE_FORMAT}", self.text_field)
        tokenizer_file = self.tokenizer_file()
        if tokenizer_file is not None:
            digest.update(hashlib.sha256(tokenizer_file.read_bytes()).digest())
        digest.update(f"{self._requested_eos_id}\0{self.eos_token}\0{self._configured_eos_token()}".encode())
        return cache_root(self.cache_dir) / f"tokens-{digest.hexdigest()[:16]}.json"

    def describe(self, split: str) -> str:
        return f"The {split} split of {self.paths} ({self.num_tokens} tokens, val_fraction {self.val_fraction})"

    def more_data_hint(self, split: str) -> str:
        return "raise data.val_fraction or add text" if split == "val" else "add text to data.paths"

    @override
    def prepare_data(self) -> None:
        """Tokenize into the cache once per node (Lightning calls this on local rank 0 only)."""
        self._build_cache()

    @override
    def setup(self, stage: str | None = None) -> None:
        meta = self._build_cache()
        self.num_tokens, self.vocab_size, self.eos_id = meta["num_tokens"], meta["vocab_size"], meta["eos_id"]
        self.token_file = Path(meta["tokens"])
        if self.num_tokens == 0:
            raise DataError(
                f"The corpus {self.paths} is empty (0 tokens in {self.token_file}). Fix: point data.paths at "
                f"non-empty text, JSONL or token files."
            )
        model_vocab_size = getattr(self.model(), "vocab_size", None)
        if isinstance(model_vocab_size, int) and not isinstance(model_vocab_size, bool):
            self.check_model_vocab(model_vocab_size, meta)
        dtype, offset = np.dtype(meta["dtype"]), meta["offset"]
        split = int(self.num_tokens * (1.0 - self.val_fraction))
        self.train_set = TokenWindows(_open_tokens(self.token_file, dtype, offset, 0, split), self.seq_len)
        self.val_set = TokenWindows(
            _open_tokens(self.token_file, dtype, offset, split, self.num_tokens - split), self.seq_len
        )

    def check_model_vocab(self, model_vocab_size: int, meta: dict[str, Any] | None = None) -> None:
        """Refuse data holding an id the model has no embedding for (an index error deep in a step otherwise).

        The largest id of each source is counted when the cache is written (arrays scanned in chunks), so the
        check costs nothing per rank, and names the source that holds it.
        """
        meta = meta or self._build_cache()
        if meta["max_id"] < model_vocab_size:
            return
        worst = max(meta["sources"], key=lambda source: source["max_id"])
        raise DataError(
            f"The data holds token id {meta['max_id']} (in {worst['path']}, cached as {meta['tokens']}), but the "
            f"model's vocab_size is {model_vocab_size}: every id must be below it. Fix: build the model with "
            f"vocab_size >= {meta['max_id'] + 1} (the data's vocab_size is {meta['vocab_size']}), or tokenize "
            f"with the model's own tokenizer (data.tokenizer)."
        )

    def _configured_eos_token(self) -> str | None:
        # tokenizer_config.json writes it as a string, or (older transformers) as a serialised AddedToken.
        directory = self.tokenizer_directory()
        if directory is None:
            return None
        config = directory / "tokenizer_config.json"
        if not config.is_file():
            return None
        try:
            token = json.loads(config.read_text()).get("eos_token")
        except (ValueError, AttributeError) as err:
            raise DataError(
                f"{config} is not a JSON object ({err}). Fix: repair or remove it, and name the EOS token with "
                f"data.eos_token."
            ) from err
        return token.get("content") if isinstance(token, dict) else token

    def _load_tokenizer(self, text_files: list[Path]) -> tuple[Any, int]:
        """The tokenizer and the EOS id, for the text to tokenize; refused with the fix if either is missing."""
        tokenizer_file = self.tokenizer_file()
        if tokenizer_file is None:
            raise DataError(
                f"data.paths holds {len(text_files)} text or JSONL files to tokenize (first {text_files[0]}) but "
                f"data.tokenizer is not set. Fix: set data.tokenizer to a local directory holding tokenizer.json, "
                f"or give pre-tokenized .bin/.npy files."
            )
        tokenizer = self._tokenizer_object(tokenizer_file)
        vocab_size = self._tokenizer_vocab_size(tokenizer)
        if self._requested_eos_id is not None:
            eos_id, source = self._requested_eos_id, "data.eos_id"
        else:
            token, source = self.eos_token, "data.eos_token"
            if token is None:
                token, source = self._configured_eos_token(), f"the eos_token of {tokenizer_file.parent}"
            if token is None:
                raise DataError(
                    f"No EOS token for the tokenizer {tokenizer_file.parent}: its tokenizer_config.json names no "
                    f"eos_token and neither data.eos_token nor data.eos_id is set; documents are joined with EOS "
                    f"between them. Fix: set data.eos_token (e.g. '<|endoftext|>') or data.eos_id."
                )
            eos_id = tokenizer.token_to_id(token)
            if eos_id is None:
                raise DataError(
                    f"The EOS token {token!r} ({source}) is not in the vocabulary of the tokenizer "
                    f"{tokenizer_file}. Fix: set data.eos_token to one of its special tokens, or data.eos_id."
                )
        if eos_id >= vocab_size:
            raise DataError(
                f"The EOS id {eos_id} ({source}) is outside the vocabulary of {vocab_size} tokens of the tokenizer "
                f"{tokenizer_file}. Fix: set data.eos_id below {vocab_size}, or data.eos_token instead."
            )
        return tokenizer, eos_id

    def _tokenizer_object(self, tokenizer_file: Path) -> Any:
        if self._loaded_tokenizer is None:
            try:
                self._loaded_tokenizer = _tokenizers().Tokenizer.from_file(str(tokenizer_file))
            except Exception as err:  # the tokenizers library raises a bare Exception for a file it cannot parse
                why = " ".join(str(err).split())
                raise DataError(
                    f"{tokenizer_file} is not a tokenizer the tokenizers library can read ({why}): the file is "
                    "damaged or cut short. Fix: save the tokenizer again (tokenizer.save_pretrained(DIR)), or copy "
                    "tokenizer.json from the model's original directory."
                ) from None
        return self._loaded_tokenizer

    @staticmethod
    def _tokenizer_vocab_size(tokenizer: Any) -> int:
        # Added tokens may sit past the base vocabulary's count; ids run up to the largest of them.
        added = max(tokenizer.get_added_tokens_decoder(), default=-1)
        return max(tokenizer.get_vocab_size(with_added_tokens=True), added + 1)

    def _documents(self, path: Path) -> Iterator[str]:
        """The documents of a text file (itself) or a JSONL file (each line's ``text_field``), empty ones left out."""
        if path.suffix != ".jsonl":
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{path} is not UTF-8 text (byte {err.start}: {err.reason}); every file but .jsonl, .bin and "
                    f".npy is read as one text document. Fix: convert it to UTF-8, or leave it out of data.paths "
                    f"(data.pattern picks the files of a directory)."
                ) from err
            if text:
                yield text
            return
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as err:
                    raise DataError(
                        f"{path} line {number} is not JSON ({err}). Fix: write one JSON object per line "
                        f'(JSON Lines), e.g. {{"{self.text_field}": "..."}}.'
                    ) from err
                text = record.get(self.text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    fields = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise DataError(
                        f"{path} line {number} has no string field {self.text_field!r} (it holds {fields}). "
                        f"Fix: set data.text_field to the field that holds each document's text, or repair the line."
                    )
                if text:
                    yield text

    def _build_cache(self) -> dict[str, Any]:
        """Tokenize into the cache unless it is there; returns its description.

        Written atomically (temporary files renamed into place, the description last) since several ranks may
        race: a description that exists always describes a complete token file.
        """
        target = self.cache_path()
        if target.exists():
            meta = _read_meta(target)
            if Path(meta["tokens"]).exists():
                return meta
        files = self.files()
        arrays = {path: open_pretokenized(path) for path in files if path.suffix in PRETOKENIZED}
        text_files = [path for path in files if path not in arrays]
        tokenizer, eos_id = self._load_tokenizer(text_files) if text_files else (None, self._requested_eos_id)
        tokenizer_file = self.tokenizer_file()
        tokenizer_vocab = None
        if tokenizer_file is not None:
            tokenizer_vocab = self._tokenizer_vocab_size(tokenizer or self._tokenizer_object(tokenizer_file))
        largest = -1 if tokenizer_vocab is None else tokenizer_vocab - 1
        maxima = {}
        for path, array in arrays.items():
            lowest, highest = min_token_id(array), max_token_id(array)
            maxima[path] = highest
            if lowest < 0:
                raise DataError(
                    f"{path} holds the token id {lowest}; token ids are never negative. Fix: write the ids the "
                    f"tokenizer gave, as an unsigned array."
                )
            if tokenizer_vocab is not None and highest >= tokenizer_vocab:
                raise DataError(
                    f"{path} holds the token id {highest}, but the tokenizer {tokenizer_file} has {tokenizer_vocab} "
                    f"tokens: the array was not written by it. Fix: set data.tokenizer to the tokenizer the array "
                    f"was written with, or unset it."
                )
            largest = max(largest, highest)
        if largest >= 1 << 32:
            raise DataError(
                f"The token ids of {self.paths} reach {largest}, beyond uint32. Fix: use a tokenizer with fewer "
                f"than 2**32 tokens."
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        if len(files) == 1 and arrays:
            # One array alone is the token stream already: map it where it is (nanoGPT's train.bin is many GB).
            array = arrays[files[0]]
            sources = [{"path": str(files[0]), "num_tokens": len(array), "max_id": maxima[files[0]]}]
            token_file, dtype, offset = files[0], array.dtype, getattr(array, "offset", 0)
        else:
            token_file, offset = target.with_suffix(".bin"), 0
            dtype = np.dtype(np.uint16 if largest < 1 << 16 else np.uint32)
            sources = self._write_tokens(token_file, files, arrays, dtype, tokenizer, eos_id)
        meta = {
            "format": CACHE_FORMAT,
            # The cache's own file by name, so a cache directory mounted elsewhere (another node) still finds it.
            "tokens": token_file.name if token_file.parent == target.parent else str(token_file),
            "offset": int(offset),
            "dtype": dtype.str,
            "num_tokens": sum(source["num_tokens"] for source in sources),
            "max_id": max((source["max_id"] for source in sources), default=-1),
            "vocab_size": tokenizer_vocab if tokenizer_vocab is not None else largest + 1,
            "eos_id": eos_id,
            "sources": sources,
        }
        write_atomically(target, lambda out: out.write(json.dumps(meta, indent=1).encode()))
        return _read_meta(target)

    def _write_tokens(
        self,
        token_file: Path,
        files: list[Path],
        arrays: dict[Path, np.ndarray],
        dtype: np.dtype,
        tokenizer: Any,
        eos_id: int | None,
    ) -> list[dict[str, Any]]:
        def write(out: Any) -> _CacheWriter:
            writer = _CacheWriter(out, dtype, len(files), tokenizer, eos_id)
            for index, path in enumerate(files):
                if path in arrays:
                    writer.add_array(arrays[path], index)
                else:
                    for text in self._documents(path):
                        writer.add_document(text, index)
            writer.flush()
            return writer

        writer = write_atomically(token_file, write)
        return [
            {"path": str(path), "num_tokens": count, "max_id": largest}
            for path, count, largest in zip(files, writer.counts, writer.maxima)
        ]
