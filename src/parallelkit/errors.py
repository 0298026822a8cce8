"""parallelkit's exceptions: each message names the field, the numbers and a fix."""


class ParallelkitError(Exception):
    """Base class of every error parallelkit raises on purpose (the CLI prints these without a traceback)."""


class MeshError(ParallelkitError, ValueError):
    """A `mesh_shape` that cannot be built on the processes at hand."""


class PlanError(ParallelkitError, ValueError):
    """A model that cannot be parallelised as asked (its contract, or sizes that do not divide)."""


class PluginError(ParallelkitError):
    """A plugin that cannot be loaded or registered."""


class DataError(ParallelkitError, ValueError):
    """A corpus or batch layout that cannot feed the run."""


class PluginWarning(UserWarning):
    """A plugin that failed to load or clashed with another; every other plugin still loads."""


class ConfigError(ParallelkitError, ValueError):
    """A strategy argument or Trainer flag that parallelkit cannot honour."""


class ReplicaGroupError(ParallelkitError):
    """A replica group cannot go on: its step keeps failing to commit, or the groups do not fit together."""
