"""`parallelkit.grad_norm` is `parallelkit.optimizers.grad_norm` (moved there; this path stays importable)."""

import sys

from parallelkit.optimizers import grad_norm as moved

sys.modules[__name__] = moved
