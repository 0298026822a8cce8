"""What parallelkit's language models share: the next-token loss, the steps and their logging, and AdamW with a
warmup and cosine schedule. A subclass gives the network (`forward(inputs) -> logits`) and its parallel plan."""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchmetrics import MeanMetric
from typing_extensions import override

from parallelkit.mesh import data_parallel_group

Batch = tuple[torch.Tensor, torch.Tensor]
"""`(inputs, targets)`: token ids, and the next token of each (what parallelkit's datamodules yield)."""


class CausalLM(L.LightningModule):
    """Base of the language models: steps on `(inputs, targets)` batches, metrics over the data-parallel group.

    Subclasses call `save_hyperparameters()` with `lr`, `weight_decay`, `betas`, `warmup_steps` and
    `min_lr_ratio` among their arguments (the optimizer reads them).
    """

    def __init__(self) -> None:
        super().__init__()
        self.val_loss = MeanMetric()

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
        # Metrics average over the data-parallel group only: tp/pp ranks of one replica hold the same batch.
        self.dp_group = data_parallel_group(self.trainer.strategy)
        self.val_loss.process_group = self.dp_group

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.pipeline_loss(self(x), y) + self.auxiliary_loss()
        self.log("train_loss", loss, on_step=True, prog_bar=True, sync_dist=True, sync_dist_group=self.dp_group)
        return loss

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        x, y = batch
        self.val_loss.update(self.pipeline_loss(self(x), y))

    @override
    def on_validation_epoch_end(self) -> None:
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
        """Logits for the batch's inputs: the first element of an `(inputs, targets)` batch, or the batch itself."""
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
        """AdamW, weight decay on matrices and embeddings only; linear warmup to `lr`, then cosine decay to
        `lr * min_lr_ratio` on the run's last step."""
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
