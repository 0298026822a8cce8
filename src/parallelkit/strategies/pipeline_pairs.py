"""Preference pairs through a pipeline schedule: every microbatch whole pairs, the reference's pass first.

The batch's rows are reordered so that each of the schedule's microbatches holds whole pairs (its chosen rows, then
the same pairs' rejected rows: a preference batch of its own). With a reference (the model with its adapters off, or
a frozen copy split into stages as the model), a forward-only pass of its schedule runs first, and the last stage
keeps each microbatch's reference log-probs; then the training (or validation) pass, whose loss on the last stage is
the microbatch's preference loss (the model's `microbatch_loss`), scaled as the strategy scales a loss (the
microbatches' mean, over accumulation). The last stage's metric sums are broadcast to the other stages, which log
them as it does.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from parallelkit.contract import IGNORE_INDEX, is_preference_batch
from parallelkit.errors import ConfigError

ROWS = ("input_ids", "labels", "position_ids")
"""A preference batch's per-row tensors (the rest are per pair or per batch)."""


def check_pairs(pairs: int, microbatches: int) -> None:
    """Refuse a batch of `pairs` pairs that `microbatches` microbatches cannot hold as whole pairs."""
    if pairs % microbatches:
        raise ConfigError(
            f"a preference batch of {pairs} pairs (data.batch_size) under a pipeline of {microbatches} microbatches: "
            "each microbatch holds whole pairs, so the microbatches must divide the pairs. Fix: "
            f"--data.init_args.batch_size={microbatches * max(pairs // microbatches, 1)}, or "
            "--trainer.strategy.microbatches to a divisor of it."
        )


def pair_order(pairs: int, microbatches: int) -> torch.Tensor:
    """The order of a batch's rows (its `pairs` chosen rows, then their rejected rows) that gives each of
    `microbatches` equal chunks whole pairs: its chosen rows, then the same pairs' rejected rows."""
    check_pairs(pairs, microbatches)
    size = pairs // microbatches
    chunks = [torch.arange(j * size, (j + 1) * size) for j in range(microbatches)]
    return torch.cat([torch.cat([chunk, pairs + chunk]) for chunk in chunks])


def whole_pairs(batch: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
    """`batch` with its rows in `order` (`pair_order`)."""
    return {key: value[order.to(value.device)] if key in ROWS else value for key, value in batch.items()}


def padded(batch: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """A preference batch's rows right-padded (or cut) to `length` tokens, before a cp split: the stages exchange
    activations of the shape they were built for, every batch alike. Past `length` a row holds padding alone (no
    sequence is longer); below, more padding: never a target, and after every real token of its row."""
    rows, have = batch["input_ids"].shape
    batch = dict(batch)
    for key, fill in (("input_ids", 0), ("labels", IGNORE_INDEX)):
        batch[key] = torch.nn.functional.pad(batch[key][:, :length], (0, max(length - have, 0)), value=fill)
    batch["position_ids"] = torch.arange(length, device=batch["input_ids"].device).expand(rows, length).contiguous()
    return batch


class PipelinePairs:
    """The preference steps of a `PipelineStrategy` (the module's docstring); `mode` is set while a pass runs, and the
    strategy's loss function then hands each microbatch to `loss`."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.mode: str | None = None
        self.references: dict[int, torch.Tensor] = {}
        self.sums: dict[int, torch.Tensor] = {}
        self.first = (0, 1)  # the batch's targets: where they start, and one microbatch's bytes
        self.scale = 1.0  # of a microbatch's loss: the microbatches' mean, over accumulation
        self.chosen_targets: torch.Tensor | None = None
        self.reference_schedule: Any = None  # a frozen copy's stages (the strategy builds them), else the model's
        self.schedule: Any = None
        self.stage_args: Any = None
        self.last: int | None = None

    def bind(self, schedule: Any, stage_args: Any, last: int | None) -> None:
        """Run through the strategy's `schedule`, the first stage's arguments from `stage_args(batch, inputs)`, `last`
        the global rank of the last stage when this rank holds it (else None)."""
        self.schedule, self.stage_args, self.last = schedule, stage_args, last

    def check(self, datamodule: Any = None) -> None:
        """Refuse, before launch, what the pipeline cannot do in preference tuning (on `datamodule`'s batches)."""
        if getattr(datamodule, "batch_size", None) is not None:
            check_pairs(datamodule.batch_size, self.strategy.microbatches)

    def padded(self, batch: Any) -> Any:
        """A preference batch padded to the pairs' `max_length` (`padded`), before the strategy's cp split; any
        other batch as it is."""
        if not is_preference_batch(batch):
            return batch
        length = getattr(getattr(self.strategy.lightning_module.trainer, "datamodule", None), "seq_len", None)
        if length is None:
            raise ConfigError(
                "preference tuning under pipelines needs the pairs' max_length to give every batch one shape: train "
                "on a parallelkit.data.PreferenceDataModule (trainer.fit(model, datamodule=...))."
            )
        return padded(batch, length)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        module = self.strategy.lightning_module
        # Which microbatch: its targets are a view of the batch's. Not the order of the calls: torch's stage also
        # calls the loss once while it infers its backward's shapes, on a copy of the first microbatch's.
        index = (target.data_ptr() - self.first[0]) // self.first[1]
        if self.mode == "reference":
            self.references[index] = module.microbatch_reference(output, target)
            return output.new_zeros(())
        reference = self.references.get(index)
        loss, sums = module.microbatch_loss(output, target, reference, self.chosen_targets, self.strategy.microbatches)
        self.sums[index] = sums
        return loss * self.scale

    def _arrange(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor, tuple, Any]:
        """`(batch in whole-pair microbatches, its row order, the first stage's arguments, the last stage's targets)`;
        the microbatches' targets located for `loss`."""
        strategy = self.strategy
        if strategy.resolved.plan.auxiliary_loss is not None:
            raise ConfigError(
                "preference tuning under pipelines with a router's load-balancing loss (output_router_logits): not "
                "done yet. Fix: output_router_logits: false, or train without pp."
            )
        order = pair_order(batch["pair_index"].shape[0], strategy.microbatches)
        batch = whole_pairs(batch, order)
        labels = batch["labels"]
        self.references, self.sums, self.chosen_targets = {}, {}, batch["chosen_targets"]
        self.first = (
            labels.data_ptr(),
            labels.stride(0) * labels.element_size() * (len(labels) // strategy.microbatches),
        )
        args = self.stage_args(batch, batch["input_ids"])
        return batch, order, args, labels if self.last is not None else None

    def _reference_pass(self, schedule: Any, context: Any, args: tuple, target: Any) -> None:
        """A forward-only pass of `schedule` in `context`: the last stage keeps each microbatch's log-probs."""
        self.mode = "reference"
        try:
            with torch.no_grad(), context, self.strategy.loss_context():
                schedule.eval(*args, target=target, return_outputs=False)
        finally:
            self.mode = None

    def reference_logps(self, batch: dict[str, torch.Tensor], context: Any) -> torch.Tensor:
        """The log-probs of `batch`'s rows (in its own order) by the model's stages in `context`, on every stage: what
        a precomputed reference stores."""
        arranged, order, args, target = self._arrange(batch)
        self._reference_pass(self.schedule, context, args, target)
        rows = arranged["input_ids"].shape[0]
        found = (
            torch.cat([self.references[j] for j in range(self.strategy.microbatches)])
            if self.last is not None
            else torch.zeros(rows, device=self.strategy.root_device)
        )
        dist.broadcast(found, src=self.strategy.last_stage_rank, group=self.strategy.pp_group)
        logps = torch.empty_like(found)
        logps[order.to(found.device)] = found
        return logps

    def run(self, batch: dict[str, torch.Tensor], train: bool) -> tuple[torch.Tensor, int]:
        """One step over `batch`'s pairs through the strategy's schedule: `(this rank's metric sums, the pairs)`, the
        same on every stage."""
        strategy, module = self.strategy, self.strategy.lightning_module
        stored = module.stored_reference(batch, "train" if train else "val")  # precomputed log-probs, or None
        batch, order, args, target = self._arrange(batch)
        if stored is not None:
            self.references = dict(enumerate(stored[order.to(stored.device)].chunk(strategy.microbatches)))
        elif self.reference_schedule is not None:  # a frozen copy's stages
            self._reference_pass(self.reference_schedule, nullcontext(), args, target)
        elif (context := module.pipeline_reference()) is not None:  # the model's own, its adapters off
            self._reference_pass(self.schedule, context, args, target)
        self.mode = "policy"
        try:
            accumulate = module.trainer.accumulate_grad_batches if train else 1
            self.scale = 1 / (strategy.microbatches * accumulate)
            run = self.schedule.step if train else self.schedule.eval
            with strategy.loss_context():
                run(*args, target=target, losses=[], return_outputs=False)
        finally:
            self.mode = None
        total = (
            torch.stack(list(self.sums.values())).sum(0)
            if self.last is not None
            else torch.zeros(module.PREFERENCE_SUMS, device=strategy.root_device)
        )
        dist.broadcast(total, src=strategy.last_stage_rank, group=strategy.pp_group)
        return total, batch["pair_index"].shape[0]
