"""Packed rows of tokenized examples, and the sampler that tells each batch its optimizer step's target count.

A row holds whole examples one after another (an example longer than the row cut to it), the rest padding; each row
is a token batch row (`parallelkit.contract.TOKEN_BATCH`): positions restart at every example, labels are -100
where nothing is trained, and `num_targets` is the count the loss divides by (`StepTargetSampler`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate
from typing_extensions import override

from parallelkit.contract import IGNORE_INDEX, REPLICA_TARGETS
from parallelkit.data.sampler import GlobalBatchSampler


class Examples:
    """Tokenized examples, one after another: `tokens[offsets[i]:offsets[i + 1]]` is example `i`, `targets` the
    same positions' target flags."""

    def __init__(self, tokens: np.ndarray, targets: np.ndarray, offsets: np.ndarray) -> None:
        self.tokens, self.targets, self.offsets = tokens, targets, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def example(self, index: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
        start = int(self.offsets[index])
        end = min(int(self.offsets[index + 1]), start + limit)
        return np.asarray(self.tokens[start:end], dtype=np.int64), np.asarray(self.targets[start:end])


class PackedRows(Dataset):
    """Rows of `seq_len` tokens, row `r` holding the examples `members[bounds[r]:bounds[r + 1]]` one after another
    (an example longer than `seq_len` cut to it), the rest padding.

    An example of n tokens takes n positions: its position j predicts its token j + 1 when that one is a target, and
    its last position predicts nothing (the next token belongs to another example). Padding forms an example of its
    own, with no targets. Item `r`, or `(r, step_targets, replica_targets)` as `StepTargetSampler` hands it, is a
    token batch row.
    """

    def __init__(self, examples: Examples, members: np.ndarray, bounds: np.ndarray, seq_len: int, pad_id: int) -> None:
        self.examples, self.members, self.bounds = examples, members, bounds
        self.seq_len, self.pad_id = seq_len, pad_id
        # Targets per row: each example's target flags after its first token (the first is nobody's prediction),
        # up to its cut.
        flags = np.concatenate([[0], np.cumsum(examples.targets, dtype=np.int64)])
        starts = np.asarray(examples.offsets[:-1])
        ends = np.minimum(np.asarray(examples.offsets[1:]), starts + seq_len)
        per_example = flags[ends] - flags[np.minimum(starts + 1, ends)]
        self.targets = np.add.reduceat(per_example[members], bounds[:-1]) if len(members) else np.zeros(0, np.int64)
        self.real_tokens = int(np.minimum(examples.lengths(), seq_len)[members].sum())

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, item: int | tuple[int, int, Any]) -> dict[str, torch.Tensor]:
        row, step_targets, replica_targets = item if isinstance(item, tuple) else (item, None, None)
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros(self.seq_len, dtype=np.int64)
        at = 0
        for index in self.members[self.bounds[row] : self.bounds[row + 1]]:
            tokens, targets = self.examples.example(int(index), self.seq_len)
            n = len(tokens)
            input_ids[at : at + n] = tokens
            labels[at : at + n - 1] = np.where(targets[1:], tokens[1:], IGNORE_INDEX)
            positions[at : at + n] = np.arange(n)
            at += n
        positions[at:] = np.arange(self.seq_len - at)  # the padding: an example of its own
        count = int(self.targets[row]) if step_targets is None else step_targets
        row_batch = {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(positions),
            "num_targets": torch.tensor(count),
        }
        if replica_targets is not None:
            row_batch[REPLICA_TARGETS] = torch.tensor(replica_targets)
        return row_batch


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack the rows; `num_targets` and `replica_targets`, the same in each, stay one."""
    batch = default_collate(rows)
    for key in ("num_targets", REPLICA_TARGETS):
        if key in batch:
            batch[key] = batch[key][0]
    return batch


class StepTargetSampler(GlobalBatchSampler):
    """A `GlobalBatchSampler` whose indices come as `(index, step_targets)`: the targets of the optimizer step the
    sample trains in, summed over its global micro-batches (`accumulate` of them per step, counted from the epoch's
    start as Lightning counts; the epoch's last step may have fewer). With `per_replica`, `(index, step_targets,
    replica_targets)`: the same step's count of each data-parallel replica, a tuple (replica groups sum those of the
    groups that take part in the step).

    Args:
        targets: the target count of each sample.
        accumulate: micro-batches per optimizer step (the trainer's `accumulate_grad_batches`; 1 for evaluation).
        per_replica: hand each replica's count too.
        **kwargs: `GlobalBatchSampler`'s.
    """

    def __init__(self, targets: np.ndarray, accumulate: int, per_replica: bool = False, **kwargs: Any) -> None:
        super().__init__(len(targets), **kwargs)
        self.targets = torch.as_tensor(np.asarray(targets, dtype=np.int64))
        self.accumulate, self.per_replica = accumulate, per_replica

    @override
    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        batches, first = self.epoch_batches()
        per_replica = self.targets[batches].sum(dim=2)  # (global batches, replicas)
        step = torch.arange(len(per_replica)) // self.accumulate
        steps = int(step[-1]) + 1 if len(step) else 0
        replica_targets = torch.zeros(steps, self.num_replicas, dtype=torch.long).index_add_(0, step, per_replica)
        replica_targets = replica_targets[step][first:]
        mine = batches[first:, self.rank]
        counts = replica_targets.sum(dim=1)[:, None].expand_as(mine).reshape(-1).tolist()
        if not self.per_replica:
            return iter(zip(mine.reshape(-1).tolist(), counts))
        replicas = [tuple(row) for row in replica_targets.tolist() for _ in range(mine.shape[1])]
        return iter(zip(mine.reshape(-1).tolist(), counts, replicas))
