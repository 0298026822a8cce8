"""transformers' private names: a model's tensor-, pipeline- and expert-parallel plans, how its tensors are saved,
whether its attention runs torch's SDPA, and its own weight initialisation run again."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.nn import Module


def hf_tp_plan(model: Module) -> dict[str, str]:
    """A Hugging Face model's whole tensor-parallel plan (module glob -> HF style name), its own entries (e.g.
    `lm_head`) and its base model's, prefixed, as `PreTrainedModel.post_init` gathers them into `_tp_plan`."""
    return dict(model._tp_plan or {})


def hf_pp_plan(model: Module) -> dict[str, Any]:
    """A Hugging Face causal LM's pipeline pieces in order (module name -> (input names, output names)): its base
    model's `config.base_model_pp_plan`, prefixed, then its own (`_pp_plan`, the head)."""
    base = model.base_model_prefix
    pieces = {f"{base}.{name}": io for name, io in (model.config.base_model_pp_plan or {}).items()}
    return {**pieces, **(type(model)._pp_plan or {})}


def hf_ep_plan(model: Module) -> dict[str, str]:
    """A Hugging Face model's expert-parallel plan (module glob -> HF style name): its base model's
    `config.base_model_ep_plan`, prefixed with the base model's name (as `hf_tp_plan`'s entries are)."""
    base = model.base_model_prefix
    return {
        f"{base}.{name}": style for name, style in (getattr(model.config, "base_model_ep_plan", None) or {}).items()
    }


def hf_conversions(model: Module) -> list[Any]:
    """How a transformers model's tensors are saved when they differ from how it holds them (fused experts saved one
    expert at a time, legacy names): `WeightRenaming`/`WeightConverter` objects, as `from_pretrained` applies them.
    transformers 5.x: `conversion_mapping.get_model_conversion_mapping` (not exported at the top level; PEFT uses
    it)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(model))


def hf_supports_sdpa(config: Any) -> bool:
    """Whether the causal-LM class transformers builds for `config` runs torch's scaled_dot_product_attention (its
    `_supports_sdpa`; Gemma 2's does not, for its attention softcapping). Unknown to the causal-LM mapping: True."""
    import transformers

    try:
        family = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return True
    return bool(family._supports_sdpa)


def hf_attention_function(model: Module) -> str:
    """The attention implementation a transformers model's config names (its `_attn_implementation`: "sdpa",
    "eager", or one registered with `AttentionInterface`); transformers 5.x has no public reader."""
    return model.config._attn_implementation


def hf_initialize(model: Module) -> None:
    """Run a Hugging Face model's own weight initialisation (`_init_weights` on every module) again, on tensors
    that already exist. transformers marks modules and tensors it initialised with `_is_hf_initialized` and skips
    them afterwards; the marks are cleared first."""
    for obj in (*model.modules(), *model.parameters(), *model.buffers()):
        if getattr(obj, "_is_hf_initialized", False):
            obj._is_hf_initialized = False
    model.initialize_weights()


def hf_router_outputs(model: Module) -> tuple[type, int] | None:
    """What a Hugging Face MoE model records as its routers' logits when asked for `output_router_logits`: the
    router module class and the index of the logits in its output (`_can_record_outputs`); None when it records
    none."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    return (target, getattr(recorder, "index", 0)) if isinstance(target, type) else None


def hf_load_balancing_loss(model: Module) -> Any:
    """The family's own `load_balancing_loss_func(gate_logits, num_experts, top_k)` (its modeling module's), or None."""
    import sys

    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
