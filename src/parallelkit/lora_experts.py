"""`parallelkit.lora_experts` is `parallelkit.adapters.experts` (moved there; this path stays importable)."""

import sys

from parallelkit.adapters import experts as moved

sys.modules[__name__] = moved
