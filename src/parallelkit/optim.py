"""`parallelkit.optim` is `parallelkit.optimizers.compiled` (moved there; this path stays importable)."""

import sys

from parallelkit.optimizers import compiled as moved

sys.modules[__name__] = moved
