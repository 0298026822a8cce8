"""Supervised fine-tuning data: instruction records tokenized with their target masks, packed into sequences that
keep each example apart, and batches whose loss is the token mean of the whole optimizer step.

A batch is a token batch (`parallelkit.contract.TOKEN_BATCH`): `input_ids`, `labels` (each position's next token
where that token is a target, else -100), `position_ids` restarting at 0 at every example (the models build each
example's own causal mask from them: no token attends across a boundary), and `num_targets`, the targets of the
optimizer step's global batch (every data-parallel rank, every accumulated micro-batch), which the models divide the
summed loss by. The global order of rows, and the resume position, are those of every parallelkit datamodule.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader
from typing_extensions import override

from parallelkit.data.chat import (
    ChatEncoder,
    builtin_conversations,
    load_tokenizer,
)
from parallelkit.data.chat_sources import ChatSources
from parallelkit.data.packing import Examples, PackedRows, StepTargetSampler, collate
from parallelkit.data.sampler import GlobalBatchSampler
from parallelkit.data.sft_sizing import SmallDataCheck
from parallelkit.data.stream import PositionedLoader, TokenStreamDataModule, cache_root
from parallelkit.errors import DataError

CACHE_FORMAT = 2
"""Part of every cache name: raised when what the cache holds, or how records become tokens, changes."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
"""The files of a tokenizer directory whose contents name the cache (a changed template makes a new one)."""


class SFTDataModule(ChatSources, SmallDataCheck, TokenStreamDataModule):
    """Instruction fine-tuning data: conversations and prompt/completion pairs, masked, packed, token-mean batches.

    Records (`parallelkit.data.chat`): JSONL lines, Parquet and Arrow files, `datasets` `save_to_disk`
    directories, each record `{"messages": [{"role", "content"}, ...]}` or `{"prompt", "completion"}`. They are
    tokenized once into a cache every rank maps (named by the sources, the tokenizer's files and the options).
    The first `1 - val_fraction` of the records train, the rest validate.

    Each example is at most `seq_len` tokens: a longer one is cut to its first `seq_len` (`overlong: truncate`) or
    left out (`drop`); either way the count is reported. With `packing` (the default), examples are laid one after
    another into rows of `seq_len`, in an order shuffled by `seed`, a row closed when the next example does not fit;
    without, each row holds one example and padding.

    Args:
        paths: files, directories (searched for `pattern`, `save_to_disk` directories read whole) or globs. None:
            built-in generated conversations (present on every machine).
        tokenizer: a local directory holding a Hugging Face tokenizer (`tokenizer.json`, and its chat template in
            `tokenizer_config.json` or `chat_template.jinja`). Default: the model's own (`HFCausalLM(pretrained=)`
            from a directory holding one), else a built-in byte-level tokenizer with a chat template (259 ids).
        chat_template: a Jinja chat template, or the path of a file holding one, used instead of the tokenizer's.
        train_on: `assistant`: only the assistant turns' tokens (a completion's) are targets; `all`: every token.
        packing: several examples per row (True), or one example per row, padded (False).
        seq_len: tokens per row.
        batch_size: rows per process per step (the micro-batch).
        val_fraction: fraction of the records, from the end, that validate.
        seed: seed of the packing order and of the training order (epoch e shuffles with seed + e).
        num_workers: DataLoader worker processes per rank.
        cache_dir: where the tokenized examples are cached; default `$PARALLELKIT_CACHE` or ~/.cache/parallelkit.
        pattern: file-name pattern for files inside directories given in `paths`.
        split: the split of a `save_to_disk` DatasetDict to read.
        overlong: `truncate` or `drop` examples longer than `seq_len`.
    """

    def __init__(
        self,
        paths: str | list[str] | None = None,
        tokenizer: str | None = None,
        chat_template: str | None = None,
        train_on: str = "assistant",
        packing: bool = True,
        seq_len: int = 256,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        seed: int = 1234,
        num_workers: int = 0,
        cache_dir: str | None = None,
        pattern: str = "*",
        split: str = "train",
        overlong: str = "truncate",
    ) -> None:
        super().__init__(seq_len=seq_len, batch_size=batch_size, seed=seed, num_workers=num_workers)
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"val_fraction is {val_fraction}; it must be in [0, 1). Fix: e.g. data.val_fraction=0.05.")
        if overlong not in ("truncate", "drop"):
            raise DataError(f"data.overlong is {overlong!r}; it must be 'truncate' or 'drop'.")
        if train_on not in ("assistant", "all"):
            raise DataError(f"data.train_on is {train_on!r}; it must be 'assistant' or 'all'.")
        self.paths = [paths] if isinstance(paths, str) else None if paths is None else list(paths)
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.train_on = train_on
        self._said: dict[str, Any] | None = None  # the report last printed
        self.packing = packing
        self.val_fraction = val_fraction
        self.cache_dir = cache_dir
        self.pattern = pattern
        self.split = split
        self.overlong = overlong
        self.report: dict[str, Any] = {}
        self._lengths = np.zeros(0, dtype=np.int64)  # each example's tokens, once set up
        self._encoder: ChatEncoder | None = None

    # -- sources and tokenizer ---------------------------------------------------------------------------------
    @override
    def builtin_records(self) -> Iterator[tuple[str, Any]]:
        return builtin_conversations()

    def encoder(self) -> ChatEncoder:
        if self._encoder is None:
            directory = self.tokenizer_directory()
            self._encoder = ChatEncoder(load_tokenizer(directory), self.template(), self.train_on, str(directory))
        return self._encoder

    # -- the cache -----------------------------------------------------------------------------------------------
    def cache_path(self) -> Path:
        """The cache directory of the tokenized examples, named by a hash of the sources (paths, sizes, mtimes),
        the tokenizer's files and the options that change the tokens."""
        digest = hashlib.sha256(f"sft-{CACHE_FORMAT}\0{self.train_on}\0{self.split}\0".encode())
        digest.update((self.template() or "").encode())
        for path in self.sources():
            for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
                stat = file.stat()
                digest.update(f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        directory = self.tokenizer_directory()
        for name in TOKENIZER_FILES:
            if (directory / name).is_file():
                digest.update(name.encode() + hashlib.sha256((directory / name).read_bytes()).digest())
        return cache_root(self.cache_dir) / f"sft-{digest.hexdigest()[:16]}"

    def _build_cache(self) -> Path:
        """Tokenize every record into the cache unless it is there (a directory renamed into place when complete)."""
        target = self.cache_path()
        if (target / "meta.json").is_file():
            return target
        encoder = self.encoder()
        tokens: list[np.ndarray] = []
        targets: list[np.ndarray] = []
        for where, record in self.records():
            ids, mask = encoder.encode(record, where)
            tokens.append(ids)
            targets.append(mask)
        if not tokens:
            raise DataError(f"data.paths {self.paths} hold no record. Fix: point data.paths at instruction data.")
        offsets = np.concatenate([[0], np.cumsum([len(t) for t in tokens])]).astype(np.int64)
        flat = np.concatenate(tokens)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f"{target.name}.", suffix=".tmp"))
        try:
            np.save(staging / "tokens.npy", flat.astype(np.int32 if flat.max(initial=0) < 2**31 else np.int64))
            np.save(staging / "targets.npy", np.concatenate(targets))
            np.save(staging / "offsets.npy", offsets)
            meta = {"format": CACHE_FORMAT, "examples": len(tokens), "max_id": int(flat.max(initial=-1))}
            (staging / "meta.json").write_text(json.dumps(meta))
            os.rename(staging, target)
        except OSError:
            if not (target / "meta.json").is_file():  # not another rank's complete cache: a real failure
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    # -- setup ---------------------------------------------------------------------------------------------------
    @override
    def prepare_data(self) -> None:
        """Tokenize into the cache once per node (Lightning calls this on local rank 0 only)."""
        self._build_cache()

    @override
    def setup(self, stage: str | None = None) -> None:
        cache = self._build_cache()
        meta = json.loads((cache / "meta.json").read_text())
        examples = Examples(
            *(np.load(cache / f"{name}.npy", mmap_mode="r") for name in ("tokens", "targets", "offsets"))
        )
        encoder = self.encoder()
        self.vocab_size = len(encoder.tokenizer)
        model_vocab = getattr(self.model(), "vocab_size", None)
        if isinstance(model_vocab, int) and meta["max_id"] >= model_vocab:
            raise DataError(
                f"The SFT data holds token id {meta['max_id']} (tokenizer {encoder.source}, {self.vocab_size} ids), "
                f"but the model's vocab_size is {model_vocab}. Fix: build the model with vocab_size >= "
                f"{self.vocab_size}, or tokenize with the model's own tokenizer (data.tokenizer)."
            )
        pad = encoder.tokenizer.pad_token_id
        pad_id = pad if pad is not None else encoder.eos_id if encoder.eos_id is not None else 0
        lengths = examples.lengths()
        overlong = lengths > self.seq_len
        self._lengths = lengths
        train, val = self._split(self.val_fraction)
        self.train_set = PackedRows(examples, *self._rows(train, lengths), self.seq_len, pad_id)
        self.val_set = PackedRows(examples, *self._rows(val, lengths), self.seq_len, pad_id)
        rows = self.train_set
        self.report = {
            "examples": len(examples),
            "overlong": int(overlong.sum()),
            "longest": int(lengths.max(initial=0)),
            "train_rows": len(rows),
            "val_rows": len(self.val_set),
            "train_targets": int(rows.targets.sum()),
            "fill": rows.real_tokens / max(len(rows) * self.seq_len, 1),
        }
        if self.report == self._said:
            return  # said once before launch (`check_launch`), in this same process
        self._said = dict(self.report)
        cut = "truncated to" if self.overlong == "truncate" else "left out at"
        rank_zero_info(
            f"SFT data: {len(examples)} examples: {len(train)} train, {len(val)} validation ({self.source()}); "
            f"{self.report['overlong']} longer than {self.seq_len} tokens {cut} it (longest {self.report['longest']}); "
            f"{len(rows)} train rows "
            f"({'packed' if self.packing else 'padded'}, {self.report['fill']:.1%} of their tokens real, "
            f"{self.report['train_targets']} targets), {len(self.val_set)} val rows."
        )

    def _split(self, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
        """The indices of the examples that train and of those that validate under `val_fraction` (the last ones),
        without those `overlong: drop` leaves out."""
        lengths = self._lengths
        keep = np.flatnonzero(lengths <= self.seq_len) if self.overlong == "drop" else np.arange(len(lengths))
        split = int(round(len(lengths) * (1.0 - val_fraction)))
        return keep[keep < split], keep[keep >= split]

    def _rows(self, indices: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`(members, bounds)` of the rows holding the examples `indices`: one each, or packed in a seeded order."""
        if not self.packing:
            return indices, np.arange(len(indices) + 1)
        order = list(indices)
        random.Random(self.seed).shuffle(order)
        bounds, used = [0], 0
        for position, index in enumerate(order):
            size = min(int(lengths[index]), self.seq_len)
            if used and used + size > self.seq_len:
                bounds.append(position)
                used = 0
            used += size
        if order:
            bounds.append(len(order))
        return np.asarray(order, dtype=np.int64), np.asarray(bounds, dtype=np.int64)

    def source(self) -> str:
        """Where the records come from, for messages."""
        return "the built-in conversations" if self.paths is None else f"{self.paths}"

    def describe(self, split: str) -> str:
        return f"The {split} split of {self.source()}"

    def more_data_hint(self, split: str) -> str:
        return "raise data.val_fraction or add records" if split == "val" else "add records to data.paths"

    # -- loaders -------------------------------------------------------------------------------------------------
    @override
    def _sampler(self, dataset: Any, split: str, shuffle: bool) -> GlobalBatchSampler:
        base = super()._sampler(dataset, split, shuffle)  # checks there is a global batch
        accumulate = self.trainer.accumulate_grad_batches if split == "train" and self.trainer is not None else 1
        return StepTargetSampler(
            dataset.targets,
            accumulate,
            per_replica=split == "train",
            batch_size=base.batch_size,
            num_replicas=base.num_replicas,
            rank=base.rank,
            shuffle=shuffle,
            seed=self.seed,
        )

    @override
    def _loader(self, dataset: Any, sampler: GlobalBatchSampler) -> DataLoader:
        return PositionedLoader(
            dataset, batch_size=self.batch_size, sampler=sampler, num_workers=self.num_workers, collate_fn=collate
        )
