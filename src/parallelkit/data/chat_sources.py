"""Where instruction and preference records come from, and the tokenizer and chat template that render them: what
`SFTDataModule` and `PreferenceDataModule` share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from parallelkit.data.chat import TABULAR, builtin_tokenizer, is_dataset_directory, read_records
from parallelkit.data.stream import cache_root, find_files
from parallelkit.errors import DataError


class ChatSources:
    """Record sources, tokenizer and chat template of a chat datamodule, read from its `paths`, `pattern`, `split`,
    `tokenizer`, `chat_template` and `cache_dir`; `builtin_records()` gives the records when `paths` is None, and the
    datamodule's `model()` the model whose tokenizer is the default."""

    paths: list[str] | None
    pattern: str
    split: str
    tokenizer: str | None
    chat_template: str | None
    cache_dir: str | None

    def builtin_records(self) -> Iterator[tuple[str, Any]]:
        """The records present on every machine, read when `paths` is None (each datamodule gives its own)."""
        raise NotImplementedError

    def sources(self) -> list[Path]:
        """The record sources, in order: files, and `save_to_disk` directories taken whole."""
        found: list[Path] = []
        for entry in self.paths or []:
            path = Path(entry).expanduser()
            if is_dataset_directory(path):
                found.append(path.resolve())
            elif path.is_dir():
                files = [f for f in find_files([entry], self.pattern) if f.suffix in (".jsonl", *TABULAR)]
                if not files:
                    raise DataError(
                        f"data.paths entry {entry!r} is a directory holding no .jsonl, .parquet or .arrow file "
                        f"matching {self.pattern!r}, and no save_to_disk dataset. Fix: point data.paths at the "
                        "records."
                    )
                found.extend(files)
            else:
                found.extend(find_files([entry], self.pattern))
        return list(dict.fromkeys(found))

    def records(self) -> Iterator[tuple[str, Any]]:
        """`(where, record)` of every record, in order."""
        if self.paths is None:
            yield from self.builtin_records()
            return
        for source in self.sources():
            yield from read_records(source, self.split)

    def tokenizer_directory(self) -> Path:
        """`tokenizer`, else the model's own, else the built-in byte-level chat tokenizer."""
        if self.tokenizer is not None:
            return Path(self.tokenizer).expanduser()
        directory = getattr(self.model(), "tokenizer_directory", None)
        if directory is not None:
            return Path(directory)
        root = cache_root(self.cache_dir)
        root.mkdir(parents=True, exist_ok=True)
        return builtin_tokenizer(root)

    def template(self) -> str | None:
        """`chat_template` as a template: the text itself, or the file it names."""
        if self.chat_template is None or "{{" in self.chat_template or "{%" in self.chat_template:
            return self.chat_template
        path = Path(self.chat_template).expanduser()
        if not path.is_file():
            raise DataError(
                f"data.chat_template {self.chat_template!r} is neither a Jinja template (it has no '{{{{' or '{{%') "
                "nor an existing file. Fix: give the template's text, or the path of a .jinja file."
            )
        return path.read_text(encoding="utf-8")
