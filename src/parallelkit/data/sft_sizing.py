"""Whether the SFT data is big enough for the run, every way it can fall short said at once with one fix: a split under
one global batch, an empty validation split, a `val_check_interval` past an epoch (`SFTDataModule.check_launch`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from parallelkit.errors import DataError

VAL_FRACTIONS = (0.05, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5)
"""The val_fractions a fix for too small a validation split suggests, the smallest that works."""


class SmallDataCheck:
    """`SFTDataModule`'s check before launch, judged on its set-up examples (`_lengths`, `_split`, `_rows`): in
    place of `TokenStreamDataModule.check_launch` (first in the bases), which stops at the first split too small, it
    names every problem and the overrides that fix them all."""

    batch_size: int
    val_fraction: float
    packing: bool
    paths: Any
    seq_len: int
    train_set: Any
    val_set: Any
    _lengths: np.ndarray

    def check_launch(self, model: Any, num_replicas: int, trainer: Any) -> None:
        """Refuse, before any rank starts, every way the data is too small for the run at once (a split under one
        global batch, an empty validation split, a `val_check_interval` past an epoch), with one set of overrides
        that makes it run, where the base class would stop at the first."""
        self._launch_model = model
        self.prepare_data()
        self.setup("fit")
        problems = self.sizing_problems(num_replicas, trainer)
        if not problems:
            return
        train, val = self._split(self.val_fraction)
        rows = f"{_rows_text(len(self.train_set))} and {len(val)} validation in {_rows_text(len(self.val_set))}"
        numbered = "; ".join(f"({n}) {problem}" for n, problem in enumerate(problems, 1))
        said = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}: {numbered}"
        raise DataError(
            f"The SFT data is too small for this run: {len(self._lengths)} examples ({self.source()}), {len(train)} "
            f"train in {rows} of seq_len {self.seq_len} ({'packed' if self.packing else 'one example per row'}), "
            f"where a global batch is {self.batch_size * num_replicas} rows (data.batch_size {self.batch_size} x "
            f"data-parallel size {num_replicas}). {said}. {self._fix(num_replicas, trainer)}"
        )

    def sizing_problems(self, num_replicas: int, trainer: Any, **changes: Any) -> list[str]:
        """What stops a run on this data (set up) on `num_replicas` data-parallel processes, with `trainer`'s settings
        and this module's, but for `changes` (`batch_size`, `val_fraction`, `packing`, `val_check_interval`: None
        leaves it unjudged): a sentence with its numbers each; empty when it runs."""
        batch_size = changes.get("batch_size", self.batch_size)
        val_fraction = changes.get("val_fraction", self.val_fraction)
        packing = changes.get("packing", self.packing)
        interval = changes.get("val_check_interval", trainer.val_check_interval)
        global_batch = batch_size * num_replicas
        train, val = self._split(val_fraction)
        train_rows, val_rows = self._row_count(train, packing), self._row_count(val, packing)
        problems = []
        if train_rows < global_batch:
            problems.append(
                f"the train split holds {_rows_text(train_rows)}, fewer than one global batch of {global_batch}"
            )
        validates = trainer.limit_val_batches != 0
        if validates and not len(val):
            problems.append(
                f"the validation split is empty (val_fraction {val_fraction} of {len(self._lengths)} examples leaves "
                "none)"
            )
        elif validates and val_rows < global_batch:
            problems.append(
                f"the validation split holds {_rows_text(val_rows)}, fewer than one global batch of {global_batch}"
            )
        batches = self._epoch_batches(train_rows, global_batch, trainer)
        if self._counts_batches(interval, trainer) and interval > batches:
            problems.append(
                f"trainer.val_check_interval={interval} batches is more than an epoch's {batches} training batches, "
                "so validation would never run"
            )
        return problems

    def _fix(self, num_replicas: int, trainer: Any) -> str:
        """The overrides that make the run fit the data, keeping as much of the batch, then of the train split, as
        the data allows, packed if it can be; or what to do when nothing fits."""
        validates = trainer.limit_val_batches != 0
        fractions = [self.val_fraction, *(f for f in VAL_FRACTIONS if f > self.val_fraction and validates)]
        step = getattr(getattr(trainer, "strategy", None), "microbatches", None)
        step = step if isinstance(step, int) and step > 0 else 1  # a pipeline splits each batch into microbatches
        sizes = {self.batch_size, *(2**k * step for k in range(self.batch_size.bit_length()))}
        sizes = sorted((b for b in sizes if b <= self.batch_size and b % step == 0), reverse=True)
        for packing in dict.fromkeys((self.packing, False)):
            for batch_size in sizes:
                for fraction in fractions:
                    changes = {"batch_size": batch_size, "val_fraction": fraction, "packing": packing}
                    if not self.sizing_problems(num_replicas, trainer, **changes, val_check_interval=None):
                        return self._fixed(num_replicas, trainer, changes)
        return (
            f"Fix: add records to data.paths: no data.batch_size, data.val_fraction and data.packing fit "
            f"{num_replicas} data-parallel processes (each split needs a row per process); or lower data.seq_len."
        )

    def _fixed(self, num_replicas: int, trainer: Any, changes: dict[str, Any]) -> str:
        """The fix that makes these `changes` (and the `val_check_interval` their epoch allows), and what it gives."""
        overrides = [
            f"--data.init_args.{name}={str(value).lower() if isinstance(value, bool) else value}"
            for name, value in changes.items()
            if value != getattr(self, name)
        ]
        train, val = self._split(changes["val_fraction"])
        train_rows = self._row_count(train, changes["packing"])
        global_batch = changes["batch_size"] * num_replicas
        batches = self._epoch_batches(train_rows, global_batch, trainer)
        interval = trainer.val_check_interval
        if self._counts_batches(interval, trainer) and interval > batches:
            overrides.append(f"--trainer.val_check_interval={batches}")
        then = (
            f"{len(train)} train examples in {_rows_text(train_rows)}, {len(val)} validation in "
            f"{_rows_text(self._row_count(val, changes['packing']))}, an epoch of {batches} "
            f"batch{'es' if batches != 1 else ''} of {global_batch}"
        )
        more = "; or add records to data.paths" if self.paths is not None else ""
        return f"Fix, all at once: {' '.join(overrides)} (then {then}){more}."

    def _row_count(self, indices: np.ndarray, packing: bool) -> int:
        """The rows the examples `indices` make, packed or one each."""
        return len(self._rows(indices, self._lengths)[1]) - 1 if packing else len(indices)

    @staticmethod
    def _counts_batches(val_check_interval: Any, trainer: Any) -> bool:
        """Whether `val_check_interval` is a number of batches that must fit in an epoch (validation on, an integer
        interval, counted per epoch)."""
        return (
            trainer.limit_val_batches != 0
            and isinstance(val_check_interval, int)
            and not isinstance(val_check_interval, bool)
            and trainer.check_val_every_n_epoch is not None
        )

    @staticmethod
    def _epoch_batches(train_rows: int, global_batch: int, trainer: Any) -> int:
        per_epoch = train_rows // global_batch
        limit = trainer.limit_train_batches
        return min(per_epoch, limit) if isinstance(limit, int) else int(per_epoch * limit)


def _rows_text(count: int) -> str:
    """`count` rows, in words."""
    return f"{count} row{'' if count == 1 else 's'}"
