"""Preference data for DPO and SimPO: (prompt, chosen, rejected) records tokenized as TRL's `DPOTrainer` tokenizes
them, each pair one unit of the global order.

Records (JSONL lines, Parquet and Arrow files, `datasets` `save_to_disk` directories, read as `parallelkit.data.chat`
reads SFT records) take TRL's preference formats: an explicit prompt (`prompt`, `chosen`, `rejected`: three texts, or
three lists of turns) or an implicit one (`chosen` and `rejected` conversations sharing their first turns, which are
the prompt). A conversation is rendered by the model's chat template (or `chat_template`); text is tokenized as it is,
its completions ending with the tokenizer's EOS. As TRL does: the prompt is tokenized alone (a conversation with the
generation prompt), prompt + completion whole, and the completion is every token after the prompt's.

A batch (`parallelkit.contract.PREFERENCE_BATCH`) holds its pairs' chosen sequences first, then their rejected ones
in the same order, with the chosen completion tokens of the global micro-batch, which the optional NLL term divides
by. A pair's chosen and rejected sequences are always in the same batch, on the same rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from parallelkit.contract import IGNORE_INDEX
from parallelkit.data.chat import (
    ROLES,
    builtin_pairs,
    load_tokenizer,
)
from parallelkit.data.chat_sources import ChatSources
from parallelkit.data.packing import StepTargetSampler
from parallelkit.data.stream import PositionedLoader, TokenStreamDataModule
from parallelkit.errors import DataError

TRUNCATION_MODES = ("keep_start", "keep_end")
"""TRL's `truncation_mode`: a sequence longer than `max_length` keeps its first or its last `max_length` tokens."""

PAD_MULTIPLE = 64
"""Batches are padded to a multiple of this (or to `max_length`): divisible by any tp (sequence parallelism) and cp."""

SHOWN_PROBLEMS = 10
"""Bad records listed by name in a refusal; the rest are counted."""


class Pair:
    """One tokenized pair: the prompt's ids and each completion's (as TRL's tokenization splits them)."""

    __slots__ = ("prompt", "chosen", "rejected")

    def __init__(self, prompt: list[int], chosen: list[int], rejected: list[int]) -> None:
        self.prompt, self.chosen, self.rejected = prompt, chosen, rejected

    def sequence(self, which: str, max_length: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
        """`(ids, completion mask)` of prompt + `which` completion, truncated to `max_length` as TRL's collator
        truncates (`keep_start`: the first tokens; `keep_end`: the last)."""
        completion = self.chosen if which == "chosen" else self.rejected
        ids = np.asarray(self.prompt + completion, dtype=np.int64)
        mask = np.zeros(len(ids), dtype=bool)
        mask[len(self.prompt) :] = True
        cut = slice(None, max_length) if mode == "keep_start" else slice(-max_length, None)
        return ids[cut], mask[cut]


def _is_turns(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(turn, dict) for turn in value)


def _turn_problem(value: Any, field: str) -> str | None:
    """Why `value` is not a list of turns (`role`, `content`), or None."""
    if not isinstance(value, list) or not value:
        return f"{field!r} is not a non-empty list of turns"
    for index, turn in enumerate(value):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            return f"turn {index} of {field!r} is not {{'role': one of {', '.join(ROLES)}, 'content': a string}}"
    return None


def split_record(record: Any) -> tuple[Any, Any, Any] | str:
    """`(prompt, chosen, rejected)` of a record in either of TRL's preference formats, or why it is not one.

    An implicit prompt is the turns `chosen` and `rejected` begin with alike (TRL's `extract_prompt`)."""
    if not isinstance(record, dict):
        return f"is a {type(record).__name__}, not an object"
    missing = [field for field in ("chosen", "rejected") if record.get(field) is None]
    if missing:
        return f"has no {' and no '.join(repr(f) for f in missing)} (it holds {sorted(record)})"
    chosen, rejected = record["chosen"], record["rejected"]
    prompt = record.get("prompt")
    if prompt is None:
        if not (_is_turns(chosen) and _is_turns(rejected)):
            return "has no 'prompt', and its 'chosen' and 'rejected' are not conversations to take one from"
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        if shared == 0:
            return "has no 'prompt', and its 'chosen' and 'rejected' conversations share no first turn to be one"
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    kinds = {isinstance(value, str) for value in (prompt, chosen, rejected)}
    if len(kinds) > 1:
        return "mixes text and conversations among 'prompt', 'chosen' and 'rejected'; give all three alike"
    if kinds == {False}:
        for field, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
            if (problem := _turn_problem(value, field)) is not None:
                return problem
    if chosen == rejected:
        return "has the same 'chosen' and 'rejected' completion, which teaches nothing"
    return prompt, chosen, rejected


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens `a` and `b` share."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


class PairEncoder:
    """Preference records to `Pair`s, tokenized as TRL's `DPOTrainer` does (the module's docstring).

    Args:
        tokenizer: a transformers tokenizer.
        template: a Jinja chat template overriding the tokenizer's own; None: the tokenizer's.
        source: where the tokenizer came from, for messages.
    """

    def __init__(self, tokenizer: Any, template: str | None, source: str) -> None:
        self.tokenizer, self.template, self.source = tokenizer, template, source

    def _ids(self, value: Any, generation_prompt: bool = False) -> list[int]:
        if isinstance(value, str):
            return list(self.tokenizer(text=value)["input_ids"])
        rendered = self.tokenizer.apply_chat_template(
            value, chat_template=self.template, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
        )
        return list(rendered["input_ids"])

    def encode(self, prompt: Any, chosen: Any, rejected: Any) -> Pair | str:
        """The pair, or why its completions cannot be told from its prompt."""
        if isinstance(prompt, str):
            eos = self.tokenizer.eos_token or ""
            chosen = chosen if chosen.endswith(eos) else chosen + eos
            rejected = rejected if rejected.endswith(eos) else rejected + eos
            prompt_ids = self._ids(prompt)
            with_chosen, with_rejected = self._ids(prompt + chosen), self._ids(prompt + rejected)
        else:
            if self.template is None and not getattr(self.tokenizer, "chat_template", None):
                return (
                    f"is a conversation, and the tokenizer {self.source} has no chat template to render it (fix: set "
                    "data.chat_template, or use an instruction-tuned model's tokenizer)"
                )
            prompt_ids = self._ids(prompt, generation_prompt=True)
            with_chosen, with_rejected = self._ids(prompt + chosen), self._ids(prompt + rejected)
        shared = min(common_prefix(prompt_ids, with_chosen), common_prefix(prompt_ids, with_rejected))
        if shared < len(prompt_ids):
            return (
                f"renders its prompt alone ({len(prompt_ids)} tokens) otherwise than at the start of prompt + "
                f"completion (they part at token {shared}), so the completion's tokens cannot be told apart (fix: a "
                "chat template that renders the prompt the same way in both, or a prompt that ends on a token "
                "boundary)"
            )
        chosen_ids, rejected_ids = with_chosen[shared:], with_rejected[shared:]
        if not chosen_ids or not rejected_ids:
            return "leaves an empty completion once the prompt's tokens are taken off"
        if chosen_ids == rejected_ids:
            return "has completions that tokenize alike, which teaches nothing"
        return Pair(prompt_ids, chosen_ids, rejected_ids)


class PreferencePairs(Dataset):
    """Pairs as batch rows: item `i` (or `(i, chosen_targets)` as `StepTargetSampler` hands it) is pair `i`'s two
    truncated sequences; `collate` pads a list of them into a preference batch."""

    def __init__(self, pairs: list[Pair], max_length: int, truncation_mode: str, pad_id: int) -> None:
        self.pairs, self.max_length, self.mode, self.pad_id = pairs, max_length, truncation_mode, pad_id
        # The NLL term's count: chosen completion tokens after truncation, less a first token nothing predicts.
        self.targets = np.asarray([self._chosen_targets(pair) for pair in pairs], dtype=np.int64)

    def _chosen_targets(self, pair: Pair) -> int:
        _, mask = pair.sequence("chosen", self.max_length, self.mode)
        return int(mask[1:].sum())

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, item: int | tuple[int, int]) -> dict[str, Any]:
        index, count = item if isinstance(item, tuple) else (item, int(self.targets[item]))
        pair = self.pairs[index]
        return {
            "chosen": pair.sequence("chosen", self.max_length, self.mode),
            "rejected": pair.sequence("rejected", self.max_length, self.mode),
            "pair_index": index,
            "chosen_targets": count,
        }

    def digest(self) -> str:
        """A fingerprint of the pairs as they are trained on (their tokens, completion masks and truncation): what
        reference log-probs precomputed on them were computed on."""
        import hashlib

        digest = hashlib.sha256(f"{self.max_length} {self.mode} {len(self.pairs)}".encode())
        for pair in self.pairs:
            for side in ("chosen", "rejected"):
                ids, mask = pair.sequence(side, self.max_length, self.mode)
                digest.update(np.asarray([len(ids)], dtype=np.int64).tobytes())
                digest.update(np.asarray(ids, dtype=np.int64).tobytes() + np.asarray(mask, dtype=np.bool_).tobytes())
        return digest.hexdigest()

    def collate(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Chosen rows, then rejected rows, right-padded to a multiple of `PAD_MULTIPLE` (at most `max_length`'s)."""
        rows = [item["chosen"] for item in items] + [item["rejected"] for item in items]
        longest = max(len(ids) for ids, _ in rows)
        length = min(-(-longest // PAD_MULTIPLE), -(-self.max_length // PAD_MULTIPLE)) * PAD_MULTIPLE
        input_ids = np.full((len(rows), length), self.pad_id, dtype=np.int64)
        labels = np.full((len(rows), length), IGNORE_INDEX, dtype=np.int64)
        for row, (ids, mask) in enumerate(rows):
            input_ids[row, : len(ids)] = ids
            labels[row, : len(ids) - 1] = np.where(mask[1:], ids[1:], IGNORE_INDEX)
        return {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.arange(length).expand(len(rows), length).contiguous(),
            "pair_index": torch.tensor([item["pair_index"] for item in items]),
            "chosen_targets": torch.tensor(items[0]["chosen_targets"]),
        }


class PreferenceDataModule(ChatSources, TokenStreamDataModule):
    """Preference pairs for DPO and SimPO (`HFCausalLM(preference=...)`), tokenized as TRL's `DPOTrainer` does.

    The first `1 - val_fraction` of the pairs train, in a seeded order that is the same in every layout; the rest
    validate. Every record is checked before launch, and every bad one is named in one message: a record missing
    `chosen` or `rejected`, with equal completions, whose prompt leaves no completion token under `max_length`, or
    whose completion the chat template does not render after the prompt.

    Args:
        paths: files, directories (searched for `pattern`, `save_to_disk` directories read whole) or globs of
            preference records. None: built-in generated pairs (present on every machine).
        tokenizer: a local directory holding a Hugging Face tokenizer. Default: the model's own (its `pretrained`
            directory's), else the built-in byte-level chat tokenizer.
        chat_template: a Jinja chat template, or the path of a file holding one, used instead of the tokenizer's.
        max_length: tokens of prompt + completion kept per sequence (TRL's `max_length`).
        truncation_mode: `keep_start` (TRL's default) or `keep_end`: which end of a longer sequence is kept.
        batch_size: pairs per process per step (each a chosen and a rejected sequence).
        val_fraction: fraction of the pairs, from the end, that validate.
        seed: seed of the training order (epoch e shuffles with seed + e).
        num_workers: DataLoader worker processes per rank.
        cache_dir: where the built-in tokenizer is saved; default `$PARALLELKIT_CACHE` or ~/.cache/parallelkit.
        pattern: file-name pattern for files inside directories given in `paths`.
        split: the split of a `save_to_disk` DatasetDict to read.
    """

    def __init__(
        self,
        paths: str | list[str] | None = None,
        tokenizer: str | None = None,
        chat_template: str | None = None,
        max_length: int = 256,
        truncation_mode: str = "keep_start",
        batch_size: int = 4,
        val_fraction: float = 0.05,
        seed: int = 1234,
        num_workers: int = 0,
        cache_dir: str | None = None,
        pattern: str = "*",
        split: str = "train",
    ) -> None:
        super().__init__(seq_len=max_length, batch_size=batch_size, seed=seed, num_workers=num_workers)
        if truncation_mode not in TRUNCATION_MODES:
            raise DataError(
                f"data.truncation_mode is {truncation_mode!r}; it must be one of {', '.join(TRUNCATION_MODES)}."
            )
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"val_fraction is {val_fraction}; it must be in [0, 1). Fix: e.g. data.val_fraction=0.05.")
        self.paths = [paths] if isinstance(paths, str) else None if paths is None else list(paths)
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.max_length, self.truncation_mode = max_length, truncation_mode
        self.val_fraction, self.cache_dir, self.pattern, self.split = val_fraction, cache_dir, pattern, split
        self._pairs: list[Pair] | None = None
        self._pad_id = 0

    # -- records and tokenizer -------------------------------------------------------------------------------------
    @override
    def builtin_records(self) -> Iterator[tuple[str, Any]]:
        return builtin_pairs()

    def pairs(self) -> list[Pair]:
        """Every record as a `Pair`; refuses the data naming every bad record (at most `SHOWN_PROBLEMS` by name)."""
        if self._pairs is not None:
            return self._pairs
        directory = self.tokenizer_directory()
        tokenizer = load_tokenizer(directory)
        encoder = PairEncoder(tokenizer, self.template(), str(directory))
        pairs: list[Pair] = []
        problems: list[str] = []
        for where, record in self.records():
            split = split_record(record)
            encoded = encoder.encode(*split) if isinstance(split, tuple) else split
            if isinstance(encoded, str):
                problems.append(f"{where} {encoded}")
                continue
            if self.truncation_mode == "keep_start" and len(encoded.prompt) >= self.max_length:
                problems.append(
                    f"{where} has a prompt of {len(encoded.prompt)} tokens, which leaves no completion token within "
                    f"max_length {self.max_length} (fix: data.max_length > {len(encoded.prompt)}, "
                    "data.truncation_mode=keep_end, or a shorter prompt)"
                )
                continue
            pairs.append(encoded)
        if problems:
            listed = "\n  ".join(problems[:SHOWN_PROBLEMS])
            more = f"\n  ... and {len(problems) - SHOWN_PROBLEMS} more" if len(problems) > SHOWN_PROBLEMS else ""
            raise DataError(
                f"{len(problems)} of the {len(problems) + len(pairs)} preference records in {self.source()} cannot be "
                f"trained on:\n  {listed}{more}\nFix: correct or leave out these records. A record is "
                '{"prompt": ..., "chosen": ..., "rejected": ...} (texts, or lists of {"role", "content"} turns), or '
                '{"chosen": [turns], "rejected": [turns]} sharing their first turns.'
            )
        if not pairs:
            raise DataError(f"data.paths {self.paths} hold no record. Fix: point data.paths at preference data.")
        pad = tokenizer.pad_token_id
        self._pad_id = pad if pad is not None else tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.vocab_size = len(tokenizer)
        self._pairs = pairs
        return pairs

    def source(self) -> str:
        return "the built-in preference pairs" if self.paths is None else f"{self.paths}"

    @override
    def describe(self, split: str) -> str:
        return f"The {split} split of {self.source()} (pairs)"

    @override
    def more_data_hint(self, split: str) -> str:
        return "raise data.val_fraction or add pairs" if split == "val" else "add pairs to data.paths"

    # -- setup -----------------------------------------------------------------------------------------------------
    @override
    def setup(self, stage: str | None = None) -> None:
        pairs = self.pairs()
        model_vocab = getattr(self.model(), "vocab_size", None)
        largest = max(max(p.prompt + p.chosen + p.rejected) for p in pairs)
        if isinstance(model_vocab, int) and largest >= model_vocab:
            raise DataError(
                f"The preference data holds token id {largest} ({self.vocab_size} ids in the tokenizer), but the "
                f"model's vocab_size is {model_vocab}. Fix: tokenize with the model's own tokenizer (data.tokenizer)."
            )
        split = int(round(len(pairs) * (1.0 - self.val_fraction)))
        self.train_set = PreferencePairs(pairs[:split], self.max_length, self.truncation_mode, self._pad_id)
        self.val_set = PreferencePairs(pairs[split:], self.max_length, self.truncation_mode, self._pad_id)
        longest = max(len(p.prompt) + max(len(p.chosen), len(p.rejected)) for p in pairs)
        summary = (
            f"Preference data: {len(pairs)} pairs: {split} train, {len(pairs) - split} validation ({self.source()}); "
            f"longest sequence {longest} tokens (max_length {self.max_length}, {self.truncation_mode})."
        )
        if summary != getattr(self, "_said", None):  # once per process (`check_launch` ran setup before launch)
            self._said = summary
            rank_zero_info(summary)

    # -- loaders ---------------------------------------------------------------------------------------------------
    @override
    def _sampler(self, dataset: Any, split: str, shuffle: bool) -> StepTargetSampler:
        base = super()._sampler(dataset, split, shuffle)  # checks there is a global batch
        # Counted per global micro-batch (accumulate 1): TRL's NLL term is a token mean per micro-batch.
        return StepTargetSampler(
            dataset.targets,
            1,
            batch_size=base.batch_size,
            num_replicas=base.num_replicas,
            rank=base.rank,
            shuffle=shuffle,
            seed=self.seed,
        )

    @override
    def _loader(self, dataset: Any, sampler: Any) -> DataLoader:
        return PositionedLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=dataset.collate,
        )

    def reference_dataloader(self, split: str) -> DataLoader:
        """Every pair of `split` ("train" or "val") once, in order, as preference batches of `batch_size` pairs, this
        data-parallel rank's share of each global batch; the last global batch filled with the first pairs again, so
        every rank runs as many batches: what precomputed reference log-probs are computed over."""
        dataset = self.train_set if split == "train" else self.val_set
        replicas, rank = self.data_parallel_layout()
        step = replicas * self.batch_size
        order = [i % len(dataset) for i in range(-(-len(dataset) // step) * step)] if len(dataset) else []
        mine = [order[start + rank * self.batch_size :][: self.batch_size] for start in range(0, len(order), step)]
        return DataLoader(dataset, batch_sampler=mine, num_workers=self.num_workers, collate_fn=dataset.collate)
