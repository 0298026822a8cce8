"""Reference models that honour parallelkit's model contract."""

from parallelkit.models.gpt import GPT

__all__ = ["GPT"]
