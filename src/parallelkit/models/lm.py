"""What parallelkit's language models share: the next-token loss, the steps and their logging, and AdamW with a
warmup and cosine schedule. A subclass gives the network (`forward(inputs) -> logits`) and its parallel plan."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchmetrics import MeanMetric, Metric
from typing_extensions import override

from parallelkit.contract import IGNORE_INDEX, is_preference_batch, token_share
from parallelkit.mesh import reduction_size, token_group
from parallelkit.models.preference_steps import PreferenceSteps

Batch = tuple[torch.Tensor, torch.Tensor] | Mapping[str, torch.Tensor]
"""`(inputs, targets)`: token ids, and the next token of each (what the pretraining datamodules yield); or a token
batch (`parallelkit.contract.TOKEN_BATCH`: masked labels, positions of packed examples, the step's target count)."""


class Float32Mean(MeanMetric):
    """torchmetrics' `MeanMetric` whose sum and weight stay in fp32 (or wider) whatever the module is cast to.

    torchmetrics guards `.half()`/`.bfloat16()` but not `.to(dtype)`, which is how `precision: bf16-true` casts the
    module (parallelkit's strategies and Lightning's alike): the states became bf16, so a validation's mean was a bf16
    running sum (6.5 after 300 batches of 5.26; rounded to bf16 even after two). A metric is bookkeeping, not compute:
    it accumulates in fp32 under every precision."""

    @override
    def _apply(self, fn: Callable, exclude_state: Sequence[str] = "") -> Metric:
        metric = super()._apply(fn, exclude_state)
        if metric.dtype.is_floating_point and torch.finfo(metric.dtype).bits < 32:
            metric.set_dtype(torch.float32)  # calls `_apply` once more, at fp32
        return metric


class CausalLM(PreferenceSteps, L.LightningModule):
    """Base of the language models: steps on `(inputs, targets)` batches, metrics over the data-parallel group.

    Subclasses call `save_hyperparameters()` with `lr`, `weight_decay`, `betas`, `warmup_steps` and
    `min_lr_ratio` among their arguments (the optimizer reads them).
    """

    def __init__(self) -> None:
        super().__init__()
        self.val_loss = Float32Mean()

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; works on vocab-sharded logits under `loss_parallel()`."""
        # In fp32 whatever the compute dtype: a bf16 log-softmax over the vocabulary loses digits.
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        # Under loss parallelism the loss is a replicated DTensor; logging and metrics want a plain tensor.
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def auxiliary_loss(self) -> torch.Tensor | float:
        """What the model adds to the training loss besides the cross-entropy, from its last forward (0 here; a
        mixture-of-experts `HFCausalLM` adds its routers' load-balancing loss when its config asks for it)."""
        return 0.0

    @override
    def setup(self, stage: str) -> None:
        # Metrics average over the ranks whose tokens differ (data-parallel, and cp ranks' slices of one batch): tp/pp
        # ranks of one replica hold the same tokens.
        self.dp_group = token_group(self.trainer.strategy)
        self.val_loss.process_group = self.dp_group
        if stage == "fit":  # preference tuning's frozen copy: of the weights training starts from, before a restore
            self.frozen_reference()

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        if is_preference_batch(batch):
            return self.preference_training_step(batch, batch_idx)
        if isinstance(batch, Mapping):
            return self.token_training_step(batch, batch_idx)
        x, y = batch
        loss = self.pipeline_loss(self(x), y) + self.auxiliary_loss()
        self.log("train_loss", loss, on_step=True, prog_bar=True, sync_dist=True, sync_dist_group=self.dp_group)
        return loss

    def token_training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """A token batch's step: the loss is the mean over every target of the optimizer step's global batch.

        This process's share (`token_share`) is scaled by the ranks the gradient reduction averages over
        (data-parallel x cp: `reduction_size`) and the accumulation steps, which its mean and Lightning's division
        undo: the summed gradient is the token mean's, as one process with the whole global batch computes it.
        `train_loss` is the step's loss: the shares summed over the ranks whose tokens differ and the micro-batches so
        far (the logger writes it after the last)."""
        labels = batch["labels"]
        loss = self.pipeline_loss(self(batch["input_ids"], batch["position_ids"]), labels)
        share = token_share(loss, labels, batch["num_targets"])
        accumulate = self.trainer.accumulate_grad_batches
        self.log_step_share(share.detach(), batch_idx, accumulate)
        return share * (reduction_size(self.trainer.strategy) * accumulate) + self.auxiliary_loss()

    def log_step_share(self, share: torch.Tensor, batch_idx: int, accumulate: int) -> None:
        """Log `train_loss` as the sum of the shares of the optimizer step's micro-batches so far, over the
        data-parallel group (a pipeline strategy calls it with its stages' share)."""
        if batch_idx % accumulate == 0:
            self._step_loss = torch.zeros_like(share)
        self._step_loss = self._step_loss + share
        self.log(
            "train_loss",
            self._step_loss,
            on_step=True,
            prog_bar=True,
            sync_dist=True,
            sync_dist_group=self.dp_group,
            reduce_fx="sum",
        )

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        if is_preference_batch(batch):
            self.preference_validation_step(batch, batch_idx)
            return
        if isinstance(batch, Mapping):  # weighted by its targets: the epoch's value is the token mean
            labels = batch["labels"]
            loss = self.pipeline_loss(self(batch["input_ids"], batch["position_ids"]), labels)
            count = labels.ne(IGNORE_INDEX).sum()
            self.val_loss.update(torch.where(count > 0, loss, 0.0), weight=count)
            return
        x, y = batch
        self.val_loss.update(self.pipeline_loss(self(x), y))

    @override
    def on_validation_epoch_end(self) -> None:
        if self.log_preference_validation():
            return
        if not self.val_loss.update_called:
            return  # a pipeline strategy ran validation and logged val_loss itself
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log_epoch_loss("val", loss)

    @override
    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    @override
    def on_test_epoch_end(self) -> None:
        if not self.val_loss.update_called:
            return  # a pipeline strategy ran the test and logged test_loss itself
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log_epoch_loss("test", loss)

    @override
    def predict_step(self, batch: Batch | torch.Tensor, batch_idx: int) -> torch.Tensor:
        """Logits for the batch's inputs: the first element of an `(inputs, targets)` batch, a token batch's
        `input_ids` (at its positions), or the batch itself."""
        if isinstance(batch, Mapping):
            return self(batch["input_ids"], batch["position_ids"])
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(inputs)

    def log_epoch_loss(self, stage: str, loss: torch.Tensor) -> None:
        """Log `<stage>_loss` and `<stage>_ppl` from the metric's value, which every data-parallel rank already
        shares (the metric synchronised it): the mean over the group that `sync_dist` asks for leaves it as is, and
        tells Lightning the value is not one rank's."""
        self.log(f"{stage}_loss", loss, prog_bar=stage == "val", sync_dist=True, sync_dist_group=self.dp_group)
        self.log(f"{stage}_ppl", loss.exp(), sync_dist=True, sync_dist_group=self.dp_group)

    @override
    def configure_optimizers(self) -> dict:
        """AdamW, weight decay on matrices and embeddings only; linear warmup to `lr`, then cosine decay reaching
        `lr * min_lr_ratio` as the run ends (the last step's rate is one decay step above it)."""
        hp = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # No empty group (LoRA trains matrices only): torch's flattened optimizer state cannot load one back.
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=hp.lr, betas=hp.betas)
        total = max(int(self.trainer.estimated_stepping_batches), 1)

        def schedule(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = min((step - hp.warmup_steps) / max(total - hp.warmup_steps, 1), 1.0)
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
