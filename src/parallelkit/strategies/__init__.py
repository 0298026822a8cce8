"""parallelkit's Strategy plugins (registered through the `parallelkit.strategies` entry point)."""

from parallelkit.plugins import StrategyPreset
from parallelkit.strategies.base import ParallelkitStrategy, ShardedPrecision
from parallelkit.strategies.ddp import DDPStrategy
from parallelkit.strategies.fsdp_tp import FSDPTPStrategy, HSDPStrategy
from parallelkit.strategies.pipeline import PipelineStrategy

fsdp2 = StrategyPreset(
    FSDPTPStrategy,
    "FSDP2: every process shards parameters, gradients and optimizer state",
    {"mesh_shape": [[-1], ["fsdp"]]},
)
tp = StrategyPreset(FSDPTPStrategy, "Tensor parallel across every process", {"mesh_shape": [[-1], ["tp"]]})

gpipe = StrategyPreset(
    PipelineStrategy, "Pipeline parallel, GPipe schedule (all forwards, then all backwards)", {"schedule": "gpipe"}
)
one_f_one_b = StrategyPreset(
    PipelineStrategy, "Pipeline parallel, 1F1B schedule (bounded in-flight activations)", {"schedule": "1f1b"}
)
interleaved_1f1b = StrategyPreset(
    PipelineStrategy, "Pipeline parallel, interleaved 1F1B (virtual stages per rank)", {"schedule": "interleaved_1f1b"}
)

__all__ = [
    "DDPStrategy",
    "FSDPTPStrategy",
    "HSDPStrategy",
    "ParallelkitStrategy",
    "PipelineStrategy",
    "ShardedPrecision",
]
