"""Preference tuning's options and loss (DPO, IPO, robust DPO, SimPO), equal to TRL's; the steps that run them are
`preference_steps`.

A preference batch (`parallelkit.contract.PREFERENCE_BATCH`) holds B pairs as 2B rows, chosen first. Each row's
log-probability is the sum, over its completion tokens, of the policy's log-softmax at the target token: under loss
parallelism the vocabulary-sharded logits give it without gathering them, and under context parallelism each cp rank
sums its slice of the sequence and the sums are added across the cp ranks (an all-reduce that autograd goes back
through). The reference's come from the model with its adapters off (LoRA, QLoRA: PEFT's and TRL's way, no second
copy) or from a frozen copy of the policy that the strategy parallelises exactly as the policy
(`parallelkit.contract.FROZEN_REFERENCE`).

The loss of a micro-batch is the mean over its pairs, as TRL's `DPOTrainer` computes it; every data-parallel rank holds
as many pairs, so the gradient reduction's mean is the global batch's. What TRL logs is logged under its names, as the
global batch's values, averaged over an optimizer step's micro-batches as TRL averages them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from parallelkit.contract import IGNORE_INDEX
from parallelkit.errors import ConfigError

LOSS_TYPES = ("sigmoid", "ipo", "robust", "simpo")
"""DPO's sigmoid loss, IPO, robust DPO (label smoothing), and the reference-free SimPO."""

REFERENCES = ("auto", "copy", "adapters", "precomputed", "none")
"""Where the reference log-probs come from: a frozen copy, the model with its adapters off, the model as training
starts computed once over every pair before the first step (TRL's `precompute_ref_log_probs`), or none (SimPO).
`auto`: adapters off when the model has adapters, else a copy; none for SimPO."""

METRICS = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
)
"""What a step logs, with TRL's names (`loss` as `train_loss`); validation prefixes them with `val_`."""

PAIR_SUMS = 7  # the first seven of METRICS are sums over pairs; the two logits are sums over completion tokens


@dataclass
class Preference:
    """Preference tuning's options, named as TRL's `DPOConfig` (and `CPOConfig` for SimPO) names them.

    Args:
        loss_type: `sigmoid` (DPO), `ipo` (IPO, on log-ratios averaged over completion tokens, as TRL), `robust`
            (robust DPO: `label_smoothing` the assumed rate of flipped labels) or `simpo` (SimPO: no reference,
            log-probs averaged over completion tokens, margin `simpo_gamma`).
        beta: the temperature of the implicit reward (TRL's `beta`).
        label_smoothing: `robust`'s and `simpo`'s label noise, in [0, 0.5).
        rpo_alpha: weight of the NLL of the chosen completions added to the loss (RPO; TRL: `loss_type=["sigmoid",
            "sft"]`, `loss_weights=[1, rpo_alpha]`; CPO's `cpo_alpha` for SimPO). None: no NLL term.
        simpo_gamma: SimPO's target reward margin (TRL's `simpo_gamma`).
        reference: `auto`, `copy`, `adapters`, `precomputed` or `none` (`REFERENCES`).
    """

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    rpo_alpha: float | None = None
    simpo_gamma: float = 0.5
    reference: str = "auto"

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(
                f"model.preference.loss_type is {self.loss_type!r}; it must be one of {', '.join(LOSS_TYPES)}."
            )
        if self.reference not in REFERENCES:
            raise ConfigError(
                f"model.preference.reference is {self.reference!r}; it must be one of {', '.join(REFERENCES)}."
            )
        if self.beta <= 0:
            raise ConfigError(f"model.preference.beta is {self.beta}; it must be > 0 (TRL's default: 0.1).")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"model.preference.label_smoothing is {self.label_smoothing}; it must be in [0, 0.5).")
        if self.label_smoothing and self.loss_type not in ("robust", "simpo"):
            raise ConfigError(
                f"model.preference.label_smoothing={self.label_smoothing} with loss_type {self.loss_type!r}, which "
                "does not read it (as in TRL). Fix: loss_type: robust."
            )
        if self.loss_type == "simpo" and self.reference not in ("auto", "none"):
            raise ConfigError(
                f"model.preference.reference={self.reference!r} with loss_type simpo, which uses no reference. Fix: "
                "leave reference out."
            )
        if self.loss_type != "simpo" and self.reference == "none":
            raise ConfigError(
                f"model.preference.reference=none with loss_type {self.loss_type!r}, which compares with a reference. "
                "Fix: reference: copy (or adapters with LoRA), or loss_type: simpo."
            )

    def source(self, has_adapters: bool) -> str:
        """The reference's source for a model with or without adapters: `copy`, `adapters`, `precomputed` or
        `none`."""
        if self.loss_type == "simpo":
            return "none"
        if self.reference == "auto":
            return "adapters" if has_adapters else "copy"
        if self.reference == "adapters" and not has_adapters:
            raise ConfigError(
                "model.preference.reference=adapters, but the model has no adapters to switch off. Fix: model.lora "
                "(LoRA's reference is its base), or reference: copy."
            )
        return self.reference


def reference_source(model: nn.Module) -> str:
    """Where `model`'s preference tuning takes its reference: "copy", "adapters", or "none" (SimPO, or no preference
    tuning)."""
    preference = getattr(model, "preference", None)
    if not isinstance(preference, Preference):
        return "none"
    adapted = any(hasattr(m, "lora_disabled") or getattr(m, "expert_adapters", None) for m in model.modules())
    return preference.source(adapted)


def as_preference(value: Preference | Mapping[str, Any] | None) -> Preference | None:
    """`value` as `Preference` (a mapping as LightningCLI passes it), or None."""
    if value is None or isinstance(value, Preference):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(f"model.preference is {value!r}; give a mapping of Preference's options, e.g. {{beta: 0.1}}.")
    return Preference(**value)


def config_dict(preference: Preference | None) -> dict[str, Any] | None:
    """Plain values for the hyperparameters (and so checkpoints)."""
    return None if preference is None else asdict(preference)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """While it lasts, every adapted layer of `model` computes as its base alone (PEFT's `disable_adapter()`, TRL's
    reference for a PEFT model): linear layers skip their adapters, and experts add their adapters' update scaled by 0,
    so their weights are the base's exactly (NF4 ones dequantized as always)."""
    layers = [module for module in model.modules() if hasattr(module, "lora_disabled")]
    experts = [a for module in model.modules() for a in (getattr(module, "expert_adapters", None) or {}).values()]
    scalings = [adapter.scaling for adapter in experts]
    for layer in layers:
        layer.lora_disabled = True
    for adapter in experts:
        adapter.scaling = 0.0
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_disabled = False
        for adapter, scaling in zip(experts, scalings):
            adapter.scaling = scaling


class SequenceScores:
    """Per row of a preference batch: the completion's summed log-prob, its token count, and the sum over its tokens of
    the logits' mean over the vocabulary (TRL's `mean_logits`), each whole across the cp ranks."""

    def __init__(self, logits: torch.Tensor, labels: torch.Tensor, cp_group: Any, with_logits: bool = True) -> None:
        targets = labels.ne(IGNORE_INDEX)
        # In fp32 whatever the compute dtype; under loss parallelism the vocabulary-sharded logits need no gather.
        per_token = -F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
        per_token = _local(per_token).view(labels.shape)
        sums = [per_token.sum(-1)]
        counts = targets.sum(-1).to(per_token.dtype)
        if with_logits:
            with torch.no_grad():
                means = _local(logits.detach().float().mean(-1))
                sums.append(torch.where(targets, means, 0.0).sum(-1))
        if cp_group is not None:  # each cp rank holds a slice of every sequence: the rows' sums are added up
            sums = [dist.nn.functional.all_reduce(sums[0], group=cp_group)] + [summed(s, cp_group) for s in sums[1:]]
            counts = summed(counts, cp_group)
        self.logps, self.counts = sums[0], counts
        self.logit_sums = sums[1] if with_logits else None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor as the whole tensor every rank holds (loss parallelism's per-token values are replicated; a mean
    over the sharded vocabulary is a pending sum)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def summed(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    tensor = tensor.clone()
    dist.all_reduce(tensor, group=group)
    return tensor


def preference_loss(
    options: Preference, policy: SequenceScores, reference: SequenceScores | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(per-pair loss, chosen rewards, rejected rewards)` of a batch's B pairs (rows 0..B-1 chosen, B..2B-1 rejected),
    as TRL computes them (DPOTrainer for sigmoid, ipo, robust; CPOTrainer for simpo)."""
    chosen, rejected = policy.logps.chunk(2)
    counts_c, counts_r = policy.counts.clamp(min=1).chunk(2)
    beta = options.beta
    if options.loss_type == "simpo":  # length-normalised log-probs, no reference
        chosen, rejected = chosen / counts_c, rejected / counts_r
        logits = beta * (chosen - rejected) - options.simpo_gamma
        smoothing = options.label_smoothing
        losses = -F.logsigmoid(logits) * (1 - smoothing) - F.logsigmoid(-logits) * smoothing
        return losses, beta * chosen.detach(), beta * rejected.detach()
    ref_chosen, ref_rejected = reference.logps.chunk(2)
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if options.loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif options.loss_type == "ipo":  # TRL normalises IPO's log-ratios by the completions' lengths
        losses = (chosen_ratio / counts_c - rejected_ratio / counts_r - 1 / (2 * beta)) ** 2
    else:  # robust
        eps = options.label_smoothing
        losses = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def metric_sums(
    loss: torch.Tensor, policy: SequenceScores, rewards: tuple[torch.Tensor, torch.Tensor], pairs: int
) -> torch.Tensor:
    """This rank's sums behind `METRICS`: seven over its pairs (the loss weighted by its pairs), then the chosen and
    rejected completions' logit sums and token counts."""
    chosen, rejected = rewards
    logps_c, logps_r = policy.logps.detach().chunk(2)
    logits_c, logits_r = policy.logit_sums.chunk(2)
    counts_c, counts_r = policy.counts.chunk(2)
    return torch.stack(
        [
            loss.detach() * pairs,
            chosen.sum(),
            rejected.sum(),
            (chosen > rejected).float().sum(),
            (chosen - rejected).sum(),
            logps_c.sum(),
            logps_r.sum(),
            logits_c.sum(),
            logits_r.sum(),
            counts_c.sum(),
            counts_r.sum(),
        ]
    )


def metric_values(sums: torch.Tensor, pairs: int) -> dict[str, torch.Tensor]:
    """`METRICS` from the global batch's sums (`metric_sums`, added over the ranks) and its pair count."""
    values = dict(zip(METRICS[:PAIR_SUMS], sums[:PAIR_SUMS] / pairs))
    values["logits/chosen"] = sums[7] / sums[9].clamp(min=1)
    values["logits/rejected"] = sums[8] / sums[10].clamp(min=1)
    return values


class GivenLogps:
    """Reference log-probs handed in whole (a pipeline's reference pass), as `preference_loss` reads them."""

    def __init__(self, logps: torch.Tensor | None) -> None:
        self.logps = logps
