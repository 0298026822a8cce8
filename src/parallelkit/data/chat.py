"""Instruction data as token ids and target masks: conversations rendered by a chat template, prompt/completion pairs.

Records come from JSONL files, Parquet and Arrow files, or a Hugging Face `datasets` directory (`save_to_disk`); a
record is a conversation (`messages`: `role`/`content` turns) or a `prompt`/`completion` pair (strings, or lists of
turns). A conversation is rendered by the tokenizer's chat template, or one the config gives, through transformers'
`apply_chat_template` (Jinja in transformers' sandbox: a template cannot run code). Its targets follow the reference
libraries: a template's `{% generation %}` blocks where it has them (transformers' `return_assistant_tokens_mask`,
TRL's assistant-only loss); otherwise each assistant turn's content and its end-of-turn token (e.g. `<|im_end|>`),
not the separator the template writes after it (the turn's span is found by rendering the conversation up to the
turn and through it, less the whitespace after its last special token); a token is a target when it begins inside.

transformers, tokenizers and `datasets` (for Parquet, Arrow and `save_to_disk` data) are optional extras, imported
when used; nothing is downloaded.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from parallelkit.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
"""Roles a conversation turn may have."""

TABULAR = (".parquet", ".arrow")
"""Suffixes of files read as tables of records (through `datasets`); a `save_to_disk` directory is read whole."""

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""A `{% generation %}` block in a chat template: the assistant tokens as the template itself marks them."""

BUILTIN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The built-in tokenizer's chat template (ChatML's layout)."""


def _needs(package: str, extra: str, why: str) -> Any:
    try:
        return __import__(package)
    except ImportError as err:
        raise DataError(
            f'{why} needs the {package} package, which is not installed. Fix: pip install -e ".[{extra}]" (or '
            f'pip install "parallelkit[{extra}]").'
        ) from err


def is_dataset_directory(path: Path) -> bool:
    """Whether `path` is a directory `datasets` wrote with `save_to_disk` (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def read_records(path: Path, split: str) -> Iterator[tuple[str, Any]]:
    """`(where, record)` for each record of `path`: `where` names the file and line (or row) for error messages.

    A `.jsonl` file holds one JSON object per line (blank lines skipped); `.parquet` and `.arrow` files, and
    `save_to_disk` directories (their `split` when they hold several), are read through `datasets`."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    yield f"{path} line {number}", json.loads(line)
                except ValueError as err:
                    raise DataError(
                        f"{path} line {number} is not JSON ({err}). Fix: write one JSON object per line (JSON Lines), "
                        'e.g. {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": '
                        '"..."}]}.'
                    ) from err
        return
    datasets = _needs("datasets", "sft", f"Reading {path}")
    if is_dataset_directory(path):
        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise DataError(
                    f"{path} is a DatasetDict without a {split!r} split (it has {sorted(data)}). Fix: set data.split "
                    "to one of them."
                )
            data = data[split]
    elif path.suffix == ".arrow":
        data = datasets.Dataset.from_file(str(path))
    elif path.suffix == ".parquet":
        import pyarrow.parquet

        data = datasets.Dataset(pyarrow.parquet.read_table(str(path)))
    else:
        raise DataError(
            f"{path} is not instruction data parallelkit reads: a .jsonl, .parquet or .arrow file, or a directory "
            "written by datasets' save_to_disk. Fix: convert it, or leave it out of data.paths."
        )
    for row, record in enumerate(data):
        yield f"{path} row {row}", record


def _turns(value: Any, where: str, field: str) -> list[dict[str, str]]:
    """`value` checked as a list of turns (`role` one of `ROLES`, `content` a string)."""
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: {field!r} is {type(value).__name__ if value is not None else 'null'}, not a non-empty list of "
            'turns. Fix: write it as [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}].'
        )
    turns = []
    for index, turn in enumerate(value):
        role = turn.get("role") if isinstance(turn, dict) else None
        content = turn.get("content") if isinstance(turn, dict) else None
        if role not in ROLES:
            raise DataError(
                f"{where}: turn {index} of {field!r} has the role {role!r}; a turn's role is one of "
                f"{', '.join(ROLES)}. Fix: rename it (e.g. 'human' -> 'user', 'gpt' -> 'assistant')."
            )
        if not isinstance(content, str):
            raise DataError(
                f"{where}: turn {index} of {field!r} ({role}) has no string 'content' (it holds "
                f"{type(content).__name__}). Fix: give every turn its text as 'content'."
            )
        turns.append({"role": role, "content": content})
    return turns


class ChatEncoder:
    """Records to `(token ids, target mask)`: conversations through a chat template, prompt/completion pairs.

    Args:
        tokenizer: a transformers tokenizer (a fast one: targets are found from its character offsets).
        template: a Jinja chat template overriding the tokenizer's own; None: the tokenizer's.
        train_on: `assistant` (the assistant turns' tokens, or a completion's, are the targets) or `all`.
        source: where the tokenizer came from, for error messages.
    """

    def __init__(self, tokenizer: Any, template: str | None, train_on: str, source: str) -> None:
        if train_on not in ("assistant", "all"):
            raise DataError(f"data.train_on is {train_on!r}; it must be 'assistant' or 'all'.")
        if not getattr(tokenizer, "is_fast", False):
            raise DataError(
                f"The tokenizer {source} is not a fast (tokenizers-backed) tokenizer: its character offsets are how "
                "parallelkit finds the assistant's tokens. Fix: use a directory holding tokenizer.json."
            )
        self.tokenizer = tokenizer
        self.template = template
        self.train_on = train_on
        self.source = source
        self._special = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def encode(self, record: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
        """The record's token ids and, per token, whether it is a target."""
        if not isinstance(record, dict):
            raise DataError(f"{where} is a {type(record).__name__}, not an object. {_FIELDS}")
        if "messages" in record:
            messages = _turns(record["messages"], where, "messages")
            if not any(turn["role"] == "assistant" for turn in messages):
                raise DataError(
                    f"{where}: the conversation has no assistant turn (roles: "
                    f"{', '.join(turn['role'] for turn in messages)}), so nothing in it would be trained on. Fix: "
                    "add the assistant's reply, or leave the record out."
                )
            return self._conversation(messages, where)
        if "prompt" in record and "completion" in record:
            prompt, completion = record["prompt"], record["completion"]
            if isinstance(prompt, str) and isinstance(completion, str):
                return self._pair(prompt, completion)
            messages = _turns(prompt, where, "prompt") + _turns(completion, where, "completion")
            return self._conversation(messages, where, first_target=len(prompt))
        raise DataError(
            f"{where} has neither 'messages' nor 'prompt' and 'completion' (it holds {sorted(record)}). {_FIELDS}"
        )

    def _render(self, messages: list[dict[str, str]], where: str, generation_prompt: bool = False) -> str:
        if self.template is None and not getattr(self.tokenizer, "chat_template", None):
            raise DataError(
                f"The tokenizer {self.source} has no chat template, and {where} is a conversation, which is rendered "
                "by one. Fix: set data.chat_template (a Jinja template, or the path of a .jinja file), or use the "
                "tokenizer of an instruction-tuned model (its tokenizer_config.json or chat_template.jinja holds one)."
            )
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _marked(self) -> bool:
        """Whether the chat template in use marks its assistant tokens with `{% generation %}` blocks."""
        template = self.template if self.template is not None else self.tokenizer.chat_template
        return isinstance(template, str) and GENERATION_BLOCK.search(template) is not None

    def _turn_end(self, text: str, begin: int, end: int) -> int:
        """The end of an assistant turn's targets in `text[begin:end]` (what rendering the turn added): after its
        last special token (its end of turn) when only whitespace follows it (the template's separator)."""
        span = text[begin:end]
        last = max((span.rfind(token) + len(token) for token in self._special if token in span), default=-1)
        return begin + last if last > 0 and not span[last:].strip() else end

    def _conversation(
        self, messages: list[dict[str, str]], where: str, first_target: int = 0
    ) -> tuple[np.ndarray, np.ndarray]:
        text = self._render(messages, where)
        if self.train_on == "assistant" and self._marked():
            return self._marked_conversation(messages, text, where, first_target)
        spans = []
        if self.train_on == "assistant":
            for index, turn in enumerate(messages):
                if turn["role"] != "assistant" or index < first_target:
                    continue
                before = self._render(messages[:index], where, generation_prompt=True)
                through = self._render(messages[: index + 1], where)
                if not (through.startswith(before) and text.startswith(through)):
                    raise DataError(
                        f"{where}: the chat template of {self.source} does not render this conversation as a "
                        f"continuation of its first turns (turn {index} changes what came before it, as templates "
                        "that drop earlier turns' reasoning do), so the assistant's tokens cannot be told apart. Fix: "
                        "set data.chat_template to a template that renders each turn once, or data.train_on=all."
                    )
                spans.append((len(before), self._turn_end(text, len(before), len(through))))
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoding["input_ids"], dtype=np.int64)
        if self.train_on == "all":
            return ids, np.ones(len(ids), dtype=bool)
        starts = np.asarray([start for start, _ in encoding["offset_mapping"]], dtype=np.int64)
        targets = np.zeros(len(ids), dtype=bool)
        for begin, end in spans:
            targets |= (starts >= begin) & (starts < end)
        return ids, targets

    def _marked_conversation(
        self, messages: list[dict[str, str]], text: str, where: str, first_target: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Targets as the template's `{% generation %}` blocks mark them (transformers' assistant mask), less those of
        a prompt's turns (the turns before `first_target`)."""
        rendered = self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids = np.asarray(rendered["input_ids"], dtype=np.int64)
        targets = np.asarray(rendered["assistant_masks"], dtype=bool)
        if first_target:
            prompt_end = len(self._render(messages[:first_target], where, generation_prompt=True))
            encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            starts = np.asarray([start for start, _ in encoding["offset_mapping"]], dtype=np.int64)
            targets &= starts >= prompt_end
        return ids, targets

    def _pair(self, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
        """A plain prompt/completion pair: the texts' tokens as they are, the completion then EOS the targets."""
        encode = self.tokenizer
        head = encode(prompt, add_special_tokens=False)["input_ids"]
        tail = encode(completion, add_special_tokens=False)["input_ids"]
        if self.eos_id is not None:
            tail = [*tail, self.eos_id]
        ids = np.asarray([*head, *tail], dtype=np.int64)
        targets = np.ones(len(ids), dtype=bool)
        if self.train_on == "assistant":
            targets[: len(head)] = False
        return ids, targets


_FIELDS = (
    'Fix: write each record as {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": '
    '"..."}]} or {"prompt": "...", "completion": "..."}.'
)


def load_tokenizer(directory: Path) -> Any:
    """transformers' tokenizer from a local directory (nothing is downloaded; a tokenizer needing code is refused)."""
    transformers = _needs("transformers", "hf", "A chat tokenizer")
    if not (directory / "tokenizer.json").is_file():
        raise DataError(
            f"data.tokenizer {str(directory)!r} is not a directory holding tokenizer.json. Fix: point it at the "
            "directory a Hugging Face tokenizer was saved to (tokenizer.save_pretrained(DIR))."
        )
    try:
        return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as err:
        why = " ".join(str(err).split())
        raise DataError(
            f"The tokenizer in {directory} cannot be loaded by transformers ({why}). Fix: save it again with "
            "tokenizer.save_pretrained(DIR)."
        ) from None


def builtin_tokenizer(directory: Path) -> Path:
    """A byte-level tokenizer with a chat template, saved under `directory` (once): every byte one token (ids 0-255),
    then `<|im_end|>` (256, EOS), `<|endoftext|>` (257, padding) and `<|im_start|>` (258). The default when neither
    the data nor the model names a tokenizer: vocab_size 259."""
    target = directory / "builtin-chat-tokenizer-v1"
    if (target / "tokenizer.json").is_file():
        return target
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=BUILTIN_TEMPLATE
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    staging = directory / f"{target.name}.{random.getrandbits(32):08x}.tmp"
    tokenizer.save_pretrained(str(staging))
    try:
        staging.rename(target)
    except OSError:  # another rank saved it first
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return target


def builtin_conversations(count: int = 4000, seed: int = 0) -> Iterator[tuple[str, dict[str, Any]]]:
    """Small conversations generated from `seed` (present on every machine): arithmetic, word games and follow-up
    questions, one or two exchanges, some with a system turn. Learnable: a model that trains on them gets better."""
    rng = random.Random(seed)
    words = ("apple", "river", "planet", "garden", "silver", "window", "orange", "castle", "forest", "rocket")

    def exchange() -> tuple[str, str]:
        kind = rng.randrange(4)
        if kind == 0:
            a, b = rng.randrange(100), rng.randrange(100)
            return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
        word = rng.choice(words)
        if kind == 1:
            return f"Reverse the word '{word}'.", word[::-1]
        if kind == 2:
            return f"Spell '{word}' in capitals.", word.upper()
        return f"How many letters are in '{word}'?", f"'{word}' has {len(word)} letters."

    for index in range(count):
        messages = [{"role": "system", "content": "You answer briefly."}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 2)):
            question, answer = exchange()
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        yield f"the built-in conversations, record {index}", {"messages": messages}


def builtin_pairs(count: int = 2000, seed: int = 0) -> Iterator[tuple[str, dict[str, Any]]]:
    """Small preference pairs generated from `seed` (present on every machine): a question, the right answer chosen,
    a wrong one rejected (a sum off by a few, a word misspelt), some with a system turn. Learnable: a model that
    trains on them prefers the right answers more and more."""
    rng = random.Random(seed)
    words = ("apple", "river", "planet", "garden", "silver", "window", "orange", "castle", "forest", "rocket")
    for index in range(count):
        kind = rng.randrange(3)
        if kind == 0:
            a, b = rng.randrange(100), rng.randrange(100)
            off = a + b + rng.choice((-3, -1, 1, 2, 10))
            question, right, wrong = f"What is {a} + {b}?", f"{a} + {b} = {a + b}.", f"{a} + {b} = {off}."
        elif kind == 1:
            word = rng.choice(words)
            scrambled = list(word[::-1])
            i = rng.randrange(len(scrambled) - 1)
            scrambled[i], scrambled[i + 1] = scrambled[i + 1], scrambled[i]
            question, right, wrong = f"Reverse the word '{word}'.", word[::-1], "".join(scrambled)
            if wrong == right:
                wrong = right + right[-1]
        else:
            word = rng.choice(words)
            question, right, wrong = f"Spell '{word}' in capitals.", word.upper(), word.capitalize()
        prompt = [{"role": "system", "content": "You answer briefly."}] if rng.random() < 0.3 else []
        prompt.append({"role": "user", "content": question})
        yield (
            f"the built-in preference pairs, record {index}",
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": right}],
                "rejected": [{"role": "assistant", "content": wrong}],
            },
        )
