"""`parallelkit.quantize` is `parallelkit.adapters.nf4` (moved there; this path stays importable)."""

import sys

from parallelkit.adapters import nf4 as moved

sys.modules[__name__] = moved
