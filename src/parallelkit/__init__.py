"""parallelkit: distributed training for PyTorch Lightning, delivered as Strategy plugins.

Importing parallelkit registers every strategy found under the `parallelkit.strategies` entry point (its
own and third parties') in Lightning's StrategyRegistry, so `Trainer(strategy="<name>")` works.
"""

from parallelkit import plugins
from parallelkit.errors import DataError, MeshError, ParallelkitError, PlanError, PluginError, PluginWarning
from parallelkit.mesh import MeshSpec
from parallelkit.plugins import StrategyPreset
from parallelkit.strategies import DDPStrategy, FSDPTPStrategy, HSDPStrategy, ParallelkitStrategy, PipelineStrategy

__version__ = "0.1.0"

__all__ = [
    "DDPStrategy",
    "DataError",
    "FSDPTPStrategy",
    "HSDPStrategy",
    "ParallelkitStrategy",
    "PipelineStrategy",
    "MeshError",
    "MeshSpec",
    "ParallelkitError",
    "PlanError",
    "PluginError",
    "PluginWarning",
    "StrategyPreset",
    "__version__",
]

plugins.register_strategies()
