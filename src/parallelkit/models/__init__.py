"""Models that honour parallelkit's model contract: the reference GPT, and any Hugging Face causal LM."""

from typing import Any

from parallelkit.models.gpt import GPT
from parallelkit.models.lm import CausalLM

__all__ = ["GPT", "CausalLM", "HFCausalLM"]


def __getattr__(name: str) -> Any:
    # HFCausalLM imports nothing of transformers until used, but its module is loaded only when asked for.
    if name == "HFCausalLM":
        from parallelkit.models.hf import HFCausalLM

        return HFCausalLM
    raise AttributeError(f"module 'parallelkit.models' has no attribute {name!r}")
