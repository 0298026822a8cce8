"""A `save_pretrained` directory's tensors under the names and shapes the transformers model holds in memory.

Mixture-of-experts families save each expert's projections as tensors of their own (`mlp.experts.3.gate_proj.weight`
[I, H]), the format of their published checkpoints, and hold them fused (`mlp.experts.gate_up_proj` [E, 2I, H]):
transformers' conversion mapping says how (the experts stacked, gate and up concatenated). `ConvertedWeights` presents
the directory under the in-memory names, and reads a box of a fused tensor from the per-expert tensors it covers, so
a rank holding 4 of 128 experts reads those 4 experts' rows only. It reads the mapping's two common operations
(`MergeModulelist(dim=0)`, then `Concatenate(dim=1)`) and its renamings; a family whose checkpoint needs another is
refused by name. A directory already in the in-memory format (parallelkit's `export-hf` writes it) is read as it is.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from parallelkit.compat import hf_conversions
from parallelkit.errors import ConfigError
from parallelkit.models.hf_io import SafetensorsWeights

READ = {("MergeModulelist", 0), ("Concatenate", 1)}
"""The conversion operations read per box: (class name, dim)."""


class ConvertedWeights:
    """`weights` (a `SafetensorsWeights`) as `model` (a transformers model) names and shapes its tensors."""

    def __init__(self, weights: SafetensorsWeights, model: nn.Module) -> None:
        self.weights, self.directory = weights, weights.directory
        renamings, converters = [], []
        for transform in hf_conversions(model):
            if type(transform).__name__ == "WeightRenaming":
                renamings += [(re.compile(s), t) for s in transform.source_patterns for t in transform.target_patterns]
            elif type(transform).__name__ == "WeightConverter":
                converters.append(transform)
        self.names: dict[str, str] = {}  # in-memory name -> the checkpoint's, for tensors saved as they are held
        self.merged: dict[str, dict[tuple[int, int], str]] = {}  # fused name -> {(piece, expert): checkpoint name}
        for key in weights.files:
            renamed = key
            for pattern, target in renamings:
                renamed = pattern.sub(target, renamed)
            found = next((hit for c in converters if (hit := _match(c, renamed)) is not None), None)
            if found is None:
                self.names[renamed] = key
                continue
            target, piece, expert, converter = found
            unread = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
            if any(op not in READ for op in unread):
                raise ConfigError(
                    f"{weights.files[key]} holds {key}, which transformers converts for this model with "
                    f"{[name for name, _ in unread]}; parallelkit reads a checkpoint per rank through "
                    "MergeModulelist(dim=0) and Concatenate(dim=1) only. Fix: save the model in its in-memory format "
                    "(load it with transformers and save_pretrained it with parallelkit's export-hf), or train "
                    "without this pretrained directory."
                )
            self.merged.setdefault(target, {})[(piece, expert)] = key
        self.files = {name: weights.files[key] for name, key in self.names.items()}
        self.files |= {name: weights.files[next(iter(parts.values()))] for name, parts in self.merged.items()}

    def _pieces(self, name: str) -> list[list[str]]:
        """The checkpoint names of a fused tensor: per concatenated piece, per expert in order."""
        parts = self.merged[name]
        pieces = sorted({p for p, _ in parts})
        experts = sorted({e for _, e in parts})
        missing = [(p, e) for p in pieces for e in experts if (p, e) not in parts]
        if missing or experts != list(range(len(experts))):
            raise ConfigError(
                f"{self.directory} holds {name}'s experts {experts} with pieces {missing[:3]} missing: the "
                "checkpoint is incomplete. Fix: save the model again."
            )
        return [[parts[(p, e)] for e in experts] for p in pieces]

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.merged:
            return self.weights.shape(self.names[name])
        pieces = self._pieces(name)
        first = self.weights.shape(pieces[0][0])
        return (len(pieces[0]), sum(self.weights.shape(piece[0])[0] for piece in pieces), *first[1:])

    def dtype(self, name: str) -> torch.dtype:
        key = self.names[name] if name not in self.merged else self._pieces(name)[0][0]
        return self.weights.entries[key][1]

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The part `box` of tensor `name`; of a fused one, read from the experts and rows of each piece it covers."""
        if name not in self.merged:
            return self.weights.read(self.names[name], box)
        experts, rows, rest = box[0], box[1], box[2:]
        out = []
        for expert in range(experts.start, experts.stop):
            parts, start = [], 0
            for piece in self._pieces(name):
                key = piece[expert]
                length = self.weights.shape(key)[0]
                low, high = max(rows.start, start), min(rows.stop, start + length)
                if low < high:
                    parts.append(self.weights.read(key, (slice(low - start, high - start), *rest)))
                start += length
            out.append(torch.cat(parts))
        return torch.stack(out)


def _match(converter: Any, name: str) -> tuple[str, int, int, Any] | None:
    """(fused name, piece, expert, converter) when `name` is one of `converter`'s source tensors."""
    for piece, source in enumerate(converter.source_patterns):
        pattern = re.escape(source).replace(r"\*", r"(\d+)")
        hit = re.search(pattern, name)
        if hit is not None and hit.end() == len(name) and hit.groups():
            (target,) = converter.target_patterns
            return name[: hit.start()] + target + name[hit.end() :], piece, int(hit.group(1)), converter
    return None
