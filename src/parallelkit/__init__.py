"""parallelkit: distributed training for PyTorch Lightning, delivered as Strategy plugins.

Every strategy found under the `parallelkit.strategies` entry point (its own and third parties') is registered in
Lightning's StrategyRegistry before a Trainer reads it, so `Trainer(strategy="<name>")` works after
`import parallelkit`. Importing the package loads neither Lightning nor a plugin: its names are handed on when first
used (PEP 562), and the plugins register when Lightning's registry is first read (`plugins.register_on_first_use`).

The plugin API (what a third-party strategy or comm hook builds on, versioned by `PLUGIN_API`; see
docs/plugins.md): the strategy bases `ParallelkitStrategy`, `FSDPTPStrategy`, `PipelineStrategy`; `StrategyPreset`;
`CommHook` and `resolve_comm_hook`; `MeshSpec` and `data_parallel_mesh`; `parallelize` (the model contract applied
to a mesh); the checkpoint helpers `staging_path`, `publish`, `consolidate`; the exceptions.
"""

from importlib import import_module
from typing import Any

from parallelkit.errors import (
    ConfigError,
    DataError,
    MeshError,
    ParallelkitError,
    PlanError,
    PluginError,
    PluginWarning,
)
from parallelkit.plugins import PLUGIN_API, StrategyPreset, register_on_first_use

__version__ = "0.1.0"

_LAZY = {
    "CheckpointError": "parallelkit.checkpoint",
    "consolidate": "parallelkit.checkpoint",
    "publish": "parallelkit.checkpoint",
    "staging_path": "parallelkit.checkpoint",
    "CommHook": "parallelkit.comm",
    "resolve_comm_hook": "parallelkit.comm:resolve",
    "MeshSpec": "parallelkit.mesh",
    "data_parallel_mesh": "parallelkit.mesh",
    "Muon": "parallelkit.optimizers.muon",
    "ResolvedPlan": "parallelkit.parallel",
    "parallelize": "parallelkit.parallel",
    "resolve": "parallelkit.parallel",
    "DDPStrategy": "parallelkit.strategies",
    "FSDPTPStrategy": "parallelkit.strategies",
    "HSDPStrategy": "parallelkit.strategies",
    "ParallelkitStrategy": "parallelkit.strategies",
    "PipelineStrategy": "parallelkit.strategies",
}
"""Public names imported when first used: name -> module (`module:attribute` where the name differs)."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, _, attribute = _LAZY[name].partition(":")
        value = getattr(import_module(module), attribute or name)
    else:
        try:
            value = import_module(f"{__name__}.{name}")  # a subpackage, as an eager root would have loaded it
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


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
    "Muon",
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

register_on_first_use()
