"""Precomputed reference log-probs (`model.preference.reference: precomputed`, TRL's `precompute_ref_log_probs`).

Before the first step, the model as training starts (its adapters off if it has any: the same values, TRL's path)
computes the log-probs of every pair of the training and validation splits once, in the run's own layout: each
data-parallel rank its share of the pairs, through the strategy's cp split or pipeline schedule, summed over tp and cp
as a step sums them. They are kept by split and pair index (the data position) on every rank, saved in checkpoints
beside the loops' state (a resume in any layout reads them back, and refuses them if the pairs changed), and handed to
each step in place of a reference forward: no copy of the model, no second forward while training.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info

from parallelkit.errors import ConfigError

SPLITS = ("train", "val")
CHECKPOINT_KEY = "preference_reference"
"""Where a checkpoint holds the tables (beside the loops' state)."""


class StoredReference:
    """Each pair's reference log-probs, `tables[split]` of shape (pairs, 2): chosen, rejected; fp32, on every rank."""

    def __init__(self) -> None:
        self.tables: dict[str, torch.Tensor] = {}
        self.digest: str | None = None

    def compute(self, module: Any) -> None:
        """Compute the tables with `module` as it is (its starting weights: called before the first step)."""
        datamodule = _pairs_module(module)
        started, was_training = time.perf_counter(), module.training
        module.eval()  # the reference as TRL's: no dropout
        try:
            self.tables = {split: _computed(module, datamodule, split) for split in SPLITS}
        finally:
            module.train(was_training)
        self.digest = _digest(datamodule)
        counts = " and ".join(f"{len(table)} {split}" for split, table in self.tables.items())
        rank_zero_info(f"Reference log-probs precomputed for {counts} pairs in {time.perf_counter() - started:.1f} s.")

    def rows(self, batch: Any, split: str) -> torch.Tensor:
        """The reference log-probs of a preference batch's rows (its chosen rows, then its rejected)."""
        table = self.tables.get(split)
        if table is None:
            raise ConfigError(
                "model.preference.reference: precomputed, but no reference log-probs were computed or loaded: they are "
                "computed when fit starts, and read from a checkpoint of such a run. Fix: validate with the "
                "checkpoint of a run that trained with them (ckpt_path=...)."
            )
        pairs = table[batch["pair_index"].to(table.device)]
        return torch.cat([pairs[:, 0], pairs[:, 1]])

    def state_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, **{split: table.cpu() for split, table in self.tables.items()}}

    def load_state_dict(self, state: dict[str, Any], module: Any) -> None:
        """The tables a checkpoint of `module`'s run holds; refused if they were computed on other pairs."""
        if state["digest"] != _digest(_pairs_module(module)):
            raise ConfigError(
                "the checkpoint's precomputed reference log-probs were computed on other pairs than this run's (the "
                "data, max_length or truncation_mode changed), and the model they came from is gone. Fix: resume "
                "with the data the run started with, or start a new run from the pretrained model."
            )
        self.digest = state["digest"]
        self.tables = {split: state[split].to(module.trainer.strategy.root_device) for split in SPLITS}


def _pairs_module(module: Any) -> Any:
    datamodule = getattr(module.trainer, "datamodule", None)
    if not callable(getattr(datamodule, "reference_dataloader", None)):
        raise ConfigError(
            "model.preference.reference: precomputed computes the reference log-probs over the pairs of a "
            "parallelkit.data.PreferenceDataModule, and this run has none. Fix: trainer.fit(model, "
            "datamodule=PreferenceDataModule(...)), or reference: copy / adapters."
        )
    return datamodule


def _digest(datamodule: Any) -> str:
    return " ".join(getattr(datamodule, f"{split}_set").digest() for split in SPLITS)


def _computed(module: Any, datamodule: Any, split: str) -> torch.Tensor:
    """The (pairs, 2) table of `split`: each rank computes its share of the pairs; the ranks' tables are merged by a
    maximum over log-probs it fills with -inf where it computed none (a pair computed twice, to fill the last batch, or
    by each cp rank, has one value: the merge is exact)."""
    strategy = module.trainer.strategy
    pairs = len(getattr(datamodule, f"{split}_set"))
    table = torch.full((pairs, 2), float("-inf"), device=strategy.root_device)
    pipeline = getattr(strategy, "pairs", None)  # a pipeline's preference steps run the schedule
    loss_context = getattr(strategy, "loss_context", nullcontext)
    for batch in datamodule.reference_dataloader(split):
        batch = strategy.batch_to_device(batch)
        with torch.no_grad(), strategy.precision_plugin.forward_context():
            if pipeline is not None:
                logps = pipeline.reference_logps(batch, module.precompute_context())
            else:
                with loss_context(), module.precompute_context():
                    logps = module.reference_logps(batch)
        index = batch["pair_index"].to(table.device)
        table[index] = torch.stack(logps.float().chunk(2), dim=1)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
    missing = int(torch.isinf(table).any(dim=1).sum())
    if missing:  # every pair is in some rank's share: a data module whose loader left some out
        raise ConfigError(f"{missing} of the {pairs} {split} pairs got no precomputed reference log-probs.")
    return table
