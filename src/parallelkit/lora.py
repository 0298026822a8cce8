"""`parallelkit.lora` is `parallelkit.adapters.lora` (moved there; this path stays importable)."""

import sys

from parallelkit.adapters import lora as moved

sys.modules[__name__] = moved
