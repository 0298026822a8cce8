"""parallelkit-diloco: DiLoCo and local SGD as a parallelkit strategy plugin (`strategy="diloco"`)."""

from parallelkit import StrategyPreset
from parallelkit_diloco.strategy import DiLoCoStrategy

local_sgd = StrategyPreset(
    DiLoCoStrategy,
    "Local SGD: replicas train alone for sync_every steps, then average their parameters",
    {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False},
)

__version__ = "0.1.0"
__all__ = ["DiLoCoStrategy", "local_sgd"]
