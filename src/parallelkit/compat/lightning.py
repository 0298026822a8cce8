"""Lightning's private names: its strategies' process-group setup and mesh, the fit loop's switches, its
SIGTERM flag, ModelCheckpoint's saves, ThroughputMonitor's meters, the loggers' versions, the strategy registry and
LightningCLI's parser."""

from __future__ import annotations

import atexit
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from parallelkit.compat.torch import set_group_timeout

if TYPE_CHECKING:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import ParallelStrategy
    from torch.distributed.device_mesh import DeviceMesh


def on_first_registry_read(activate: Callable[[], None]) -> None:
    """Call `activate` (once) when Lightning's StrategyRegistry is first read after now: a Trainer reads it as it is
    built, whatever its `strategy` (so does parallelkit's CLI, checking a strategy name). The registry's class
    (Lightning's private `_StrategyRegistry`) is swapped for a subclass whose readers call `activate` and swap the
    class back: the registry is Lightning's own object throughout, and nothing is imported until a strategy is
    needed."""
    from lightning.pytorch.strategies import StrategyRegistry

    registry_class = type(StrategyRegistry)

    def first(method: str) -> Callable[..., Any]:
        def read(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.__class__ = registry_class
            activate()
            return getattr(self, method)(*args, **kwargs)

        return read

    readers = ("available_strategies", "get", "register", "__contains__", "__getitem__", "__iter__", "keys", "items")
    armed = type("StrategyRegistryBeforeParallelkit", (registry_class,), {name: first(name) for name in readers})
    if registry_class.__name__ != armed.__name__:
        StrategyRegistry.__class__ = armed


def destroy_process_groups_at_exit() -> None:
    """Destroy torch.distributed's process groups when the interpreter exits, whatever the backend.

    Lightning registers its `_destroy_dist_connection` at exit for NCCL only. A gloo group left to the interpreter's
    finalisation can abort a process whose training succeeded ("terminate called without an active exception",
    exit -6): its worker threads are destroyed after Python is gone (pytorch/pytorch#190489). Idempotent.
    """
    from lightning.fabric.utilities.distributed import _destroy_dist_connection

    atexit.unregister(_destroy_dist_connection)
    atexit.register(_destroy_dist_connection)


def setup_distributed(strategy: ParallelStrategy, join_timeout: timedelta | None = None) -> None:
    """Initialise the default process group as Lightning's ModelParallelStrategy does (`_setup_distributed`).
    `join_timeout`: how long the ranks may take to meet, when longer than the strategy's timeout (`_timeout`), which
    the default group's collectives keep."""
    timeout = strategy._timeout
    strategy._timeout = max(timeout, join_timeout or timeout)
    try:
        strategy._setup_distributed()
    finally:
        strategy._timeout = timeout
    set_group_timeout(None, timeout)


def process_group_backend(strategy: ParallelStrategy) -> str:
    """The backend the strategy's process group uses (its `process_group_backend`, else the device's default)."""
    from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device

    return getattr(strategy, "_process_group_backend", None) or _get_default_process_group_backend_for_device(
        strategy.root_device
    )


def set_device_mesh(strategy: ParallelStrategy, mesh: DeviceMesh) -> None:
    """Give the strategy and its LightningModule their mesh (`strategy.device_mesh`, `self.device_mesh`), which
    Lightning's ModelParallelStrategy keeps in `_device_mesh` on both."""
    strategy._device_mesh = mesh
    strategy.lightning_module._device_mesh = mesh


def saves_distributed_checkpoint(strategy: ParallelStrategy) -> bool:
    """The `save_distributed_checkpoint` a ModelParallelStrategy was built with."""
    return strategy._save_distributed_checkpoint


def skip_loop_backward(trainer: L.Trainer) -> None:
    """Tell the fit loop not to run zero_grad and backward itself (the switch Lightning's StochasticWeightAveraging
    uses): a pipeline schedule's step runs both."""
    trainer.fit_loop._skip_backward = True


def attached_trainer(module: L.LightningModule | None) -> L.Trainer | None:
    """The trainer `module` is attached to, or None (none yet: a Ctrl-C while Lightning's launcher starts the ranks
    reaches the strategy's exception hook before the fit attached the module)."""
    return None if module is None else module._trainer


def strategy_hook(trainer: L.Trainer, name: str, *args: Any) -> Any:
    """The strategy's hook `name` (`training_step`, `backward`) called as the fit loop calls it: what the module logs
    in it is logged as that hook's (a retried micro-batch's `train_loss` is the step's, not another hook's)."""
    from lightning.pytorch.trainer import call

    return call._call_strategy_hook(trainer, name, *args)


def should_accumulate(trainer: L.Trainer) -> bool:
    """Whether the current micro-batch is not the last of an optimizer step (the fit loop's own test)."""
    return trainer.fit_loop._should_accumulate()


def logging_a_step(trainer: L.Trainer) -> bool:
    """Whether the fit loop is in a training batch's end hooks (`on_train_batch_end`, where ModelCheckpoint saves),
    whose metrics it hands to the loggers only after all of them have run."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return trainer.training and progress.processed > progress.completed


def throughputs(monitor: Callback) -> dict[Any, Any]:
    """The `Throughput` meters Lightning's ThroughputMonitor keeps per stage, to replace with other kinds."""
    return monitor._throughputs


def note_sigterm(trainer: L.Trainer) -> None:
    """Raise the flag Lightning's training loop broadcasts from rank 0 every step and turns into a
    `SIGTERMException` on every rank, without running Lightning's own handler (see `PreemptionCheckpoint`)."""
    trainer._signal_connector.received_sigterm = True


def skip_sigterm_broadcast(trainer: L.Trainer) -> None:
    """Stop the training loop's blocking broadcast of rank 0's SIGTERM flag before every step: `PreemptionCheckpoint`
    already raises the flag on every rank at the same step, which the loop then turns into `SIGTERMException` at
    the end of that step as before."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


def last_checkpoints(callback: Any, trainer: L.Trainer) -> set[str]:
    """The `last*.ckpt` entries of a ModelCheckpoint's directory: what `ckpt_path="last"` resumes from (Lightning's
    `ModelCheckpoint._find_last_checkpoints`)."""
    return callback._find_last_checkpoints(trainer)


def last_step_saved(callback: Any) -> int:
    """The global step of a ModelCheckpoint's newest save this run (0 before any)."""
    return callback._last_global_step_saved


def logger_version(logger: Any) -> int | str | None:
    """The version a CSV or TensorBoard logger was given or has chosen so far, without choosing one (its `version`
    property picks the next free directory when first read), from Lightning's `_version`."""
    return logger._version


def set_logger_version(logger: Any, version: int | str) -> None:
    """Give a CSV or TensorBoard logger the version (its directory under `root_dir`) its `version` argument would
    have, before it has chosen one."""
    logger._version = version


def parser_keys(parser: Any, subcommand: str | None) -> list[str]:
    """The option keys LightningCLI's (jsonargparse's) parser knows for `subcommand` (or its own without one), from
    argparse's `_actions` and jsonargparse's `_subcommands_action`."""
    subcommands = getattr(parser, "_subcommands_action", None)
    chosen = subcommands.choices.get(subcommand) if subcommands is not None and subcommand else None
    target = chosen or parser
    return [action.dest for action in target._actions if action.dest and not action.dest.startswith("_")]


def before_training_state_restored(trainer: L.Trainer, hook: Callable[[], None]) -> None:
    """Call `hook` once, in this fit, between the restore of a checkpoint's model, datamodule and callbacks (when a
    `ckpt_path` was given) and the restore of its training state (precision, loops, schedulers): Lightning's
    `_CheckpointConnector.restore_training_state`, wrapped on this trainer's connector for one call. The hook may
    hand Lightning a training position of its own there (`restore_training_position`)."""
    connector = trainer._checkpoint_connector
    connector.__dict__.pop("restore_training_state", None)  # a wrapper left by a fit that failed before restoring
    restore = connector.restore_training_state

    def hook_then_restore() -> None:
        del connector.restore_training_state
        hook()
        restore()

    connector.restore_training_state = hook_then_restore


def loaded_training_position(trainer: L.Trainer) -> dict[str, Any]:
    """The training position of the checkpoint this fit resumes from (empty without one): what
    `training_position` gives, as Lightning loaded it, until it has restored it."""
    loaded = trainer._checkpoint_connector._loaded_checkpoint
    return {key: value for key, value in loaded.items() if key in _position_keys(trainer)}


def training_position(trainer: L.Trainer) -> dict[str, Any]:
    """Where the training stands as a step starts (`on_train_batch_start`): the entries of the checkpoint that
    ModelCheckpoint would have saved at the end of the step before (loops, schedulers, the datamodule's data
    position, the precision plugin's state), a copy. The batch the loop has made ready for this step is not counted:
    a loop restored from it takes that batch next."""
    import copy

    from lightning.pytorch.trainer import call

    connector = trainer._checkpoint_connector
    loops = connector._get_loops_state_dict()
    progress = loops["fit_loop"]["epoch_loop.batch_progress"]
    for counts in (progress["total"], progress["current"]):
        counts["ready"] = counts["started"]
    progress["is_last_batch"] = False
    position: dict[str, Any] = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "loops": loops,
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
    }
    if trainer.datamodule is not None:
        position[type(trainer.datamodule).__qualname__] = call._call_lightning_datamodule_hook(trainer, "state_dict")
    precision = trainer.precision_plugin.state_dict()
    if precision:
        position[type(trainer.precision_plugin).__qualname__] = precision
    return copy.deepcopy(position)


def restore_training_position(trainer: L.Trainer, position: dict[str, Any]) -> None:
    """Make `position` (a `training_position`) the one this fit starts from: the datamodule's data position now,
    the loops, schedulers and precision state when Lightning restores the training state next (call it from
    `before_training_state_restored`'s hook). The model and optimizers are the caller's to restore."""
    connector = trainer._checkpoint_connector
    connector._loaded_checkpoint = {**connector._loaded_checkpoint, **position}
    connector.restore_datamodule()


def _position_keys(trainer: L.Trainer) -> set[str]:
    keys = {"epoch", "global_step", "loops", "lr_schedulers", type(trainer.precision_plugin).__qualname__}
    if trainer.datamodule is not None:
        keys.add(type(trainer.datamodule).__qualname__)
    return keys


def rng_states() -> dict[str, Any]:
    """The random number generators' states (torch's, CUDA's, numpy's, Python's), as Lightning collects them."""
    from lightning.fabric.utilities.seed import _collect_rng_states

    return _collect_rng_states()


def set_rng_states(states: dict[str, Any]) -> None:
    """Set the random number generators to `rng_states()`'s."""
    from lightning.fabric.utilities.seed import _set_rng_states

    _set_rng_states(states)
