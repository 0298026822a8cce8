"""Context parallelism for Hugging Face families, through transformers' own attention interface.

A transformers attention module projects q, k and v, applies its rotary embedding and then calls the attention
function its config names (`ALL_ATTENTION_FUNCTIONS`). Under a cp axis `HFCausalLM` names `CP_ATTENTION`, registered
with `transformers.AttentionInterface`: the module's own code runs unchanged, and only the attention itself becomes
the `attend` that context parallelism gave the module (`parallelkit.parallel.context_parallel`), with the scale,
sliding window and score softcap the module passes. transformers builds no mask for it (an unknown implementation
gets none): the masks come from the whole sequence's positions, which arrive as `position_ids` among the module's
keyword arguments.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parallelkit.compat import hf_attention_function
from parallelkit.errors import PlanError

CP_ATTENTION = "parallelkit_context_parallel"
"""The name `split_attention` is registered under in transformers' `AttentionInterface`."""


def split_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q (batch, heads, local, dim), k and v (batch, kv_heads, local,
    dim) of this rank's tokens; returns (batch, local, heads, dim) and no weights. `attention_mask`, made by
    transformers from the rank's slice alone, is not read."""
    if refusal := _refusal(module, dropout, position_ids, kwargs):
        raise PlanError(f"{type(module).__name__} under context parallelism: {refusal} Fix: a mesh without cp.")
    positions = position_ids.expand(query.shape[0], -1)
    out = module.attend(query, key, value, positions, scale=scaling, window=sliding_window, softcap=softcap)
    return out.transpose(1, 2).contiguous(), None


def _refusal(module: nn.Module, dropout: float, position_ids: torch.Tensor | None, kwargs: dict) -> str:
    """What in one call cannot be split over cp ranks ("" when nothing): the family sweep finds these per family,
    and `HFCausalLM` refuses a family it did not pass before launch; this names it if one gets here."""
    if kwargs.get("s_aux") is not None:
        return "its attention sinks (s_aux, a learned logit in every query's softmax) are not split over cp ranks."
    if kwargs.get("position_bias") is not None:
        return "its relative position bias (position_bias) is made for the rank's slice, not the whole sequence."
    if dropout:
        return f"attention dropout ({dropout}) is not applied by parallelkit's split attention."
    if not getattr(module, "is_causal", True):
        return "it attends both ways (is_causal is False); context parallelism splits causal attention."
    if position_ids is None or position_ids.ndim != 2:
        return "its positions are not one index per token (batch, seq), from which the split's masks are made."
    return ""


def use_split_attention(model: nn.Module) -> None:
    """Make transformers' `model` call `split_attention` from every attention module (registered once)."""
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, split_attention)
    model.set_attn_implementation(CP_ATTENTION)
    if hf_attention_function(model) != CP_ATTENTION:
        raise PlanError(
            f"{model.config.model_type}: transformers does not let its attention function be set (the family does not "
            "call attention through AttentionInterface), so its sequences cannot be split over cp ranks. Fix: a mesh "
            "without cp."
        )
