"""A Hugging Face mixture of experts' load-balancing loss, summed stage by stage under pipelines.

transformers computes it from every layer's router logits together (`load_balancing_loss_func`): over all layers'
rows, the fraction of top-k picks each expert gets times the mean router probability it gets, summed over the
experts and multiplied by their number; it accumulates the per-expert pick counts, probability sums and the row
count layer by layer. A pipeline stage holds some of the layers, so it carries those sums: it adds its own layers'
to what the previous stage handed it and hands them on with the hidden states (`add_router_sums`), and the last
stage computes the loss from the totals (`router_loss`). The probability sums are differentiable: their gradient
flows back through the stages as the hidden states' does. `same_as_family` checks, on the model itself, that these
sums give the family's own function's value, so a family that computes it otherwise is refused rather than trained
with another loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from parallelkit.compat import hf_load_balancing_loss, hf_router_outputs


def router_counts(model: nn.Module) -> tuple[int, int] | None:
    """(experts, top-k) of a transformers MoE causal LM whose load-balancing loss these sums compute, or None."""
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    return (experts, top_k) if isinstance(experts, int) and isinstance(top_k, int) else None


def start_router_sums(experts: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The sums before the first layer: (picks per expert then the row count [E + 1], probability sums [E])."""
    return torch.zeros(experts + 1, device=device), torch.zeros(experts, device=device)


def add_router_sums(
    sums: tuple[torch.Tensor, torch.Tensor], logits: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sums` plus one layer's router `logits` [rows, E], accumulated as transformers' function does."""
    counts, probs = sums
    experts = probs.shape[0]
    weights = F.softmax(logits, dim=-1)
    _, picked = torch.topk(weights, top_k, dim=-1)
    histc_dtype = torch.float32 if logits.device.type in ("cpu", "mps") else torch.int32  # transformers' choice
    picks = torch.histc(picked.reshape(-1).to(histc_dtype), bins=experts, min=0, max=experts)
    rows = torch.tensor([weights.shape[0]], dtype=counts.dtype, device=counts.device)
    return counts + torch.cat([picks.to(counts.dtype), rows]), probs + weights.float().sum(dim=0)


def router_loss(sums: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The load-balancing loss of every layer's sums (transformers' value, before `router_aux_loss_coef`)."""
    counts, probs = sums
    experts, rows = probs.shape[0], counts[-1]
    return torch.sum(counts[:-1] / rows * (probs / rows).unsqueeze(0)) * experts


@contextmanager
def recorded_router_logits(model: nn.Module, layers: list[nn.Module]) -> Iterator[list[torch.Tensor]]:
    """While it lasts, the router logits `layers` (decoder layers of transformers `model`) compute, in order."""
    source = hf_router_outputs(model)
    logits: list[torch.Tensor] = []
    if source is None:
        yield logits
        return
    router_class, index = source

    def keep(_: nn.Module, __: Any, output: Any) -> None:
        logits.append(output[index] if isinstance(output, tuple) else output)

    hooks = [m.register_forward_hook(keep) for layer in layers for m in layer.modules() if isinstance(m, router_class)]
    try:
        yield logits
    finally:
        for hook in hooks:
            hook.remove()


def same_as_family(model: nn.Module) -> bool:
    """Whether the sums give the family's own `load_balancing_loss_func` on seeded random router logits (3 layers of
    16 rows), to 1e-6: the family computes the loss these sums carry."""
    own, counts = hf_load_balancing_loss(model), router_counts(model)
    if own is None or counts is None or hf_router_outputs(model) is None:
        return False
    experts, top_k = counts
    layers = torch.randn(3, 16, experts, generator=torch.Generator().manual_seed(0)).unbind(0)
    sums = start_router_sums(experts, torch.device("cpu"))
    for logits in layers:
        sums = add_router_sums(sums, logits, top_k)
    theirs = own(tuple(layers), experts, top_k)
    return isinstance(theirs, torch.Tensor) and torch.allclose(router_loss(sums), theirs.float(), rtol=1e-6, atol=0)
