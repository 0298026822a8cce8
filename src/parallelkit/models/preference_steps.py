"""Preference tuning as the steps of a language model (`PreferenceSteps`, mixed into `CausalLM`), and the frozen
reference (`FrozenCopy`). The loss and its options are `parallelkit.models.preference`'s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from parallelkit.errors import ConfigError
from parallelkit.models.preference import (
    METRICS,
    PAIR_SUMS,
    GivenLogps,
    Preference,
    SequenceScores,
    adapters_disabled,
    metric_sums,
    metric_values,
    preference_loss,
    reference_source,
    summed,
)
from parallelkit.models.preference_store import CHECKPOINT_KEY, StoredReference


class PreferenceSteps:
    """The training and validation steps of a language model on preference batches (the module's docstring). Mixed
    into `CausalLM`; a model with `preference` set (an `HFCausalLM` argument) trains on `PreferenceDataModule`."""

    preference: Preference | None = None
    PREFERENCE_SUMS = 11
    """How many sums `metric_sums` gives (what a pipeline's last stage broadcasts)."""

    def reference_kind(self) -> str:
        """`reference_source` of this model, read once: its adapters are what they were built as."""
        if getattr(self, "_reference_kind", None) is None:
            self._reference_kind = reference_source(self)
        return self._reference_kind

    def frozen_reference(self) -> nn.Module | None:
        """The reference a strategy parallelises beside the model (`parallelkit.contract.FROZEN_REFERENCE`): a copy of
        the network for `reference: copy`, else None; made once, from the network as it is at the first call (before
        the model is parallelised, or trained)."""
        if self.reference_kind() != "copy":
            return None
        if getattr(self, "_reference", None) is None:
            self._reference = [FrozenCopy(self)]  # in a list: not a submodule (no state dict, no optimizer)
        return self._reference[0]

    @override
    def on_fit_start(self) -> None:
        """Without a parallelkit strategy (which parallelises the copy with the model), the frozen copy goes where
        Lightning moved the model, in its dtype."""
        super().on_fit_start()
        reference = self.frozen_reference()
        weight = next(self.model.parameters(), None) if reference is not None else None
        if weight is not None and not isinstance(weight, DTensor):
            reference.to(device=weight.device, dtype=weight.dtype)

    def _check_preference_batch(self, batch: Mapping[str, torch.Tensor]) -> None:
        if self.preference is None:
            raise ConfigError(
                f"{type(self).__name__} got a preference batch (chosen and rejected rows) but has no model.preference. "
                "Fix: set model.init_args.preference (e.g. {beta: 0.1}), as configs/dpo.yaml does."
            )

    def _cp_group(self) -> Any:
        spec = getattr(self.trainer.strategy, "mesh_spec", None)
        return self.trainer.strategy.device_mesh["cp"].get_group() if spec is not None and spec.cp_size > 1 else None

    def _data_parallel(self) -> tuple[int, Any]:
        """The number of ranks holding different pairs, and the group over which a batch's sums are added (the
        data-parallel ranks, with the cp ranks: those hold parts of the same rows)."""
        from parallelkit.mesh import reduction_size

        spec = getattr(self.trainer.strategy, "mesh_spec", None)
        cp = spec.cp_size if spec is not None else 1
        return reduction_size(self.trainer.strategy) // cp, self.dp_group

    def preference_scores(
        self, batch: Mapping[str, torch.Tensor], split: str = "train"
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """`(per-pair loss, metric sums of this rank, the policy's scores)` of a preference batch of `split`."""
        self._check_preference_batch(batch)
        ids, positions, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
        cp_group = self._cp_group()
        policy = SequenceScores(self(ids, positions), labels, cp_group)
        aux = self.auxiliary_loss()  # the policy's (a mixture of experts' load balancing), before the reference runs
        reference = None
        source = self.reference_kind()
        if source == "precomputed":
            reference = GivenLogps(self.stored_reference(batch, split))
        elif source != "none":
            with torch.no_grad():
                if source == "adapters":
                    with adapters_disabled(self):
                        logits = self(ids, positions)
                    self.auxiliary_loss()  # the reference's, dropped
                else:
                    logits = self.frozen_reference()(ids, positions)
                reference = SequenceScores(logits, labels, cp_group, with_logits=False)
        losses, chosen, rejected = preference_loss(self.preference, policy, reference)
        pairs = losses.shape[0]
        loss = losses.mean()
        if self.preference.rpo_alpha:
            replicas, _ = self._data_parallel()
            # TRL's NLL term: a token mean over the global micro-batch's chosen completions, whatever the layout.
            nll = -policy.logps.chunk(2)[0].sum() * replicas / batch["chosen_targets"].clamp(min=1)
            loss = loss + self.preference.rpo_alpha * nll
        loss = loss + aux
        return loss, self._rank_sums(loss, policy, (chosen, rejected), pairs, cp_group), pairs

    def _rank_sums(self, loss: torch.Tensor, policy: Any, rewards: Any, pairs: int, cp_group: Any) -> torch.Tensor:
        """This rank's `metric_sums`, the pairs' shares divided over the cp ranks: every cp rank holds the same
        pairs' values, while the token sums are its own slice's."""
        sums = metric_sums(loss, policy, rewards, pairs)
        if cp_group is not None:
            sums[:PAIR_SUMS] /= dist.get_world_size(cp_group)
        return sums

    # -- a precomputed reference (`parallelkit.models.preference_store`) -------------------------------------------
    def stored_reference(self, batch: Mapping[str, torch.Tensor], split: str) -> torch.Tensor | None:
        """The precomputed reference log-probs of a preference batch's rows (`split`: "train" or "val"), or None
        when the reference is not precomputed."""
        if self.reference_kind() != "precomputed":
            return None
        return self._stored().rows(batch, split)

    def precompute_context(self) -> Any:
        """The context the reference log-probs are precomputed in: the adapters off (none without adapters)."""
        return adapters_disabled(self)

    def reference_logps(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The log-probs of a preference batch's rows by the model as it is (in `precompute_context`)."""
        logits = self(batch["input_ids"], batch["position_ids"])
        self.auxiliary_loss()  # a mixture of experts' load balancing: not the reference's to add
        return SequenceScores(logits, batch["labels"], self._cp_group(), with_logits=False).logps

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._precompute()

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._precompute()

    def _precompute(self) -> None:
        """A precomputed reference's log-probs, computed at the first validation or training start (before any step,
        after a checkpoint restored them on a resume) unless they are there."""
        if self.reference_kind() != "precomputed" or self._stored().tables:
            return
        with torch.inference_mode(False):  # the validation loop's: tables read by training's autograd later
            self._stored().compute(self)

    def _stored(self) -> StoredReference:
        if getattr(self, "_stored_reference", None) is None:
            self._stored_reference = StoredReference()
        return self._stored_reference

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.reference_kind() == "precomputed" and self._stored().tables:
            checkpoint[CHECKPOINT_KEY] = self._stored().state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if self.reference_kind() == "precomputed":
            if CHECKPOINT_KEY not in checkpoint:
                raise ConfigError(
                    "model.preference.reference: precomputed, but the checkpoint holds no precomputed reference "
                    "log-probs (it was saved by a run with another reference), and the model they would come from is "
                    "gone. Fix: resume with the run's own reference setting, or start from the pretrained model."
                )
            self._stored().load_state_dict(checkpoint[CHECKPOINT_KEY], self)

    # -- for a pipeline strategy, whose last stage sees one microbatch of pairs at a time ---------------------------
    def pipeline_reference(self) -> Any:
        """The context a pipeline's reference pass runs in, over the model's own stages: the adapters off; None without
        a reference (SimPO). A frozen copy runs in stages of its own, which the strategy builds beside the model's."""
        source = self.reference_kind()
        if source == "copy":
            raise ConfigError(
                "preference tuning with a frozen reference (model.preference.reference: copy) under a pipeline whose "
                "strategy built no stages for it. Fix: parallelkit.PipelineStrategy, which builds them."
            )
        return adapters_disabled(self) if source == "adapters" else None

    def microbatch_reference(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The reference log-probs of a pipeline microbatch's rows (its last stage's output)."""
        return SequenceScores(logits, labels, self._cp_group(), with_logits=False).logps.detach()

    def microbatch_loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        reference: torch.Tensor | None,
        chosen_targets: Any,
        microbatches: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A pipeline microbatch's preference loss (the mean over its pairs; the NLL term its share of the global
        micro-batch's token mean, times the microbatches the strategy averages over) and its metric sums. Under cp,
        each row's log-prob is summed over the cp ranks' slices, as a step without pipelines sums it."""
        cp_group = self._cp_group()
        policy = SequenceScores(logits, labels, cp_group)
        losses, chosen, rejected = preference_loss(self.preference, policy, GivenLogps(reference))
        loss = losses.mean()
        if self.preference.rpo_alpha:
            replicas, _ = self._data_parallel()
            nll = -policy.logps.chunk(2)[0].sum() * replicas * microbatches / chosen_targets.clamp(min=1)
            loss = loss + self.preference.rpo_alpha * nll
        return loss, self._rank_sums(loss, policy, (chosen, rejected), losses.shape[0], cp_group)

    def preference_training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, sums, pairs = self.preference_scores(batch)
        self.log_preference_step(sums, pairs, batch_idx)
        return loss

    def log_preference_step(self, sums: torch.Tensor, pairs: int, batch_idx: int) -> None:
        """Log a training micro-batch's metrics from this rank's sums over its `pairs` (`metric_sums`; a pipeline
        strategy hands its last stage's): the global batch's values, averaged over the optimizer step's micro-batches
        so far, as TRL averages them."""
        replicas, group = self._data_parallel()
        values = metric_values(_global(sums, group), pairs * replicas)
        accumulate = self.trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0:
            self._step_metrics = {name: torch.zeros_like(value) for name, value in values.items()}
        for name, value in values.items():  # TRL averages an optimizer step's micro-batches
            self._step_metrics[name] = self._step_metrics[name] + value / accumulate
        for name, value in self._step_metrics.items():
            key = "train_loss" if name == "loss" else name
            shown = name in ("loss", "rewards/accuracies", "rewards/margins")
            self.log(key, value, on_step=True, on_epoch=False, prog_bar=shown)  # the same on every rank

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Log `grad_norm` under preference tuning, as TRL does each step: the norm of the whole gradient the optimizer
        is about to apply (before clipping), whatever the layout."""
        super().on_before_optimizer_step(optimizer)
        if self.preference is None:
            return
        from parallelkit.optimizers.grad_norm import global_grad_norm

        stages = getattr(self.trainer.precision_plugin, "stage_group", None)  # pipeline stages hold other parameters
        norm = global_grad_norm([p.grad for p in self.parameters() if p.grad is not None], stage_group=stages)
        self.log("grad_norm", norm, on_step=True, on_epoch=False)

    def preference_validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        _, sums, pairs = self.preference_scores(batch, "val")
        self.add_preference_validation(sums, pairs, batch_idx)

    def add_preference_validation(self, sums: torch.Tensor, pairs: int, batch_idx: int) -> None:
        """Add a validation batch's metrics (this rank's sums over its `pairs`) to the epoch's."""
        replicas, group = self._data_parallel()
        values = torch.stack(list(metric_values(_global(sums, group), pairs * replicas).values()))
        if batch_idx == 0 or getattr(self, "_val_metrics", None) is None:
            self._val_metrics = [torch.zeros_like(values), 0]
        self._val_metrics[0] = self._val_metrics[0] + values
        self._val_metrics[1] += 1

    def log_preference_validation(self) -> bool:
        """Log `val_<metric>`: the mean over the validation's batches (as TRL's evaluation); False if none ran."""
        totals = getattr(self, "_val_metrics", None)
        if totals is None:
            return False
        self._val_metrics = None
        for name, value in zip(METRICS, totals[0] / totals[1]):
            # The same on every rank already: the mean over the group says so to Lightning, and changes nothing.
            shown = name in ("loss", "rewards/accuracies")
            self.log(f"val_{name}", value, prog_bar=shown, sync_dist=True, sync_dist_group=self.dp_group)
        return True


def _global(sums: torch.Tensor, group: Any) -> torch.Tensor:
    """`sums` added over `group` (every data-parallel rank's, and cp's slices), detached."""
    if not dist.is_available() or not dist.is_initialized():
        return sums.detach()
    return summed(sums.detach(), group)


class FrozenCopy(nn.Module):
    """The reference network: a copy of a model's network (its `self.model`, a transformers causal LM) under the
    model's own module names, never trained. The strategy parallelises it like the model and gives it the model's
    values; without a parallelkit strategy it is the model's network as it starts training."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        import copy

        network = getattr(model, "model", None)
        if not isinstance(network, nn.Module):
            raise ConfigError(
                f"{type(model).__name__}: reference: copy copies the network the model holds as `self.model`, and it "
                "holds none. Fix: train with LoRA (reference: adapters), or hold the network as self.model."
            )
        self.model = copy.deepcopy(network)
        self.model.requires_grad_(False)
        self._route = getattr(type(model), "route_attention", None)  # it reads only `self.model`
        # The model as the copy's owner: the model's own attributes, its network the copy. Held in a list: not a
        # submodule.
        view = object.__new__(type(model))
        view.__dict__.update(model.__dict__)
        view.__dict__["_modules"] = {**dict(model.named_children()), "model": self.model}
        self._view = [view]
        self.eval()

    def on_copy(self, method: Any) -> Any:
        """`method` of the model (a pipeline plan's stage forward) run on the copy instead; any other callable as it
        is (it reads only the layers it is handed)."""
        function = getattr(method, "__func__", None)
        if function is None or not isinstance(method.__self__, type(self._view[0])):
            return method
        return function.__get__(self._view[0])

    def route_attention(self) -> None:
        """Context parallelism's attention for the copy's attention modules, as the model routes its own
        (`parallelkit.contract.ATTENTION_HOOK`)."""
        if self._route is None:
            raise ConfigError("the frozen reference's model routes no attention for context parallelism.")
        self._route(self)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        output = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        return getattr(output, "logits", output)
