"""parallelkit: distributed training for PyTorch Lightning, delivered as Strategy plugins.

Importing parallelkit registers every strategy found under the `parallelkit.strategies` entry point (its
own and third parties') in Lightning's StrategyRegistry, so `Trainer(strategy="<name>")` works.

The plugin API (what a third-party strategy or comm hook builds on, versioned by `PLUGIN_API`; see
docs/plugins.md): the strategy bases `ParallelkitStrategy`, `FSDPTPStrategy`, `PipelineStrategy`; `StrategyPreset`;
`CommHook` and `resolve_comm_hook`; `MeshSpec` and `data_parallel_mesh`; `parallelize` (the model contract applied
to a mesh); the checkpoint helpers `staging_path`, `publish`, `consolidate`; the exceptions.
"""

from parallelkit import plugins
from parallelkit.checkpoint import CheckpointError, consolidate, publish, staging_path
from parallelkit.comm import CommHook
from parallelkit.comm import resolve as resolve_comm_hook
from parallelkit.compat import quiet_known_noise
from parallelkit.errors import (
    ConfigError,
    DataError,
    MeshError,
    ParallelkitError,
    PlanError,
    PluginError,
    PluginWarning,
)
from parallelkit.mesh import MeshSpec, data_parallel_mesh
from parallelkit.parallel import ResolvedPlan, parallelize, resolve
from parallelkit.plugins import PLUGIN_API, StrategyPreset
from parallelkit.strategies import DDPStrategy, FSDPTPStrategy, HSDPStrategy, ParallelkitStrategy, PipelineStrategy

__version__ = "0.1.0"

__all__ = [
    "PLUGIN_API",
    "CheckpointError",
    "CommHook",
    "ConfigError",
    "DDPStrategy",
    "DataError",
    "FSDPTPStrategy",
    "HSDPStrategy",
    "MeshError",
    "MeshSpec",
    "ParallelkitError",
    "ParallelkitStrategy",
    "PipelineStrategy",
    "PlanError",
    "PluginError",
    "PluginWarning",
    "StrategyPreset",
    "__version__",
    "consolidate",
    "data_parallel_mesh",
    "parallelize",
    "resolve",
    "ResolvedPlan",
    "publish",
    "resolve_comm_hook",
    "staging_path",
]

plugins.register_strategies()
quiet_known_noise()
