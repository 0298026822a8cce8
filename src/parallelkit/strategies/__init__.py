"""parallelkit's Strategy plugins (registered through the `parallelkit.strategies` entry point)."""

from parallelkit.plugins import StrategyPreset
from parallelkit.strategies.base import ParallelkitStrategy, ShardedPrecision
from parallelkit.strategies.fsdp_tp import FSDPTPStrategy, HSDPStrategy

fsdp2 = StrategyPreset(
    FSDPTPStrategy,
    "FSDP2: every process shards parameters, gradients and optimizer state",
    {"mesh_shape": [[-1], ["fsdp"]]},
)
tp = StrategyPreset(FSDPTPStrategy, "Tensor parallel across every process", {"mesh_shape": [[-1], ["tp"]]})

__all__ = ["FSDPTPStrategy", "HSDPStrategy", "ParallelkitStrategy", "ShardedPrecision"]
