"""`parallelkit.muon` is `parallelkit.optimizers.muon` (moved there; this path stays importable)."""

import sys

from parallelkit.optimizers import muon as moved

sys.modules[__name__] = moved
