"""Adapters: what trains in place of a frozen base, and how that base is stored.

Rooms:
- `lora`: low-rank adapters on linear layers (`LoRA`, `LoRALinear`, `add_adapters`), their tensor-parallel styles,
  QLoRA's frozen base (`quantize_base`), what a checkpoint of adapters holds (`trainable_names`);
- `experts`: adapters on a mixture of experts' stacked weights (one per expert), and PEFT's names for them;
- `nf4`: the NF4 storage of frozen weights (torchao's), dense and per expert, and its bytes.

The old paths (`parallelkit.lora`, `parallelkit.lora_experts`, `parallelkit.quantize`) are these modules. The names
below are handed on when first used, so importing one room loads no other.
"""

from parallelkit.lazy import handed_on

_NAMES = {
    "LoRA": "lora",
    "LoRALinear": "lora",
    "add_adapters": "lora",
    "has_adapters": "lora",
    "trainable_names": "lora",
    "read_peft_adapters": "experts",
    "peft_names": "experts",
    "is_nf4": "nf4",
}

__getattr__ = handed_on(__name__, _NAMES)
__all__ = sorted(_NAMES)
