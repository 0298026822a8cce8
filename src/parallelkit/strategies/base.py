"""What every parallelkit strategy shares: the named mesh, data-parallel bookkeeping, precision and clipping.

`ParallelkitStrategy` subclasses Lightning's `ModelParallelStrategy` on purpose: that is Lightning's FSDP2/DTensor
strategy, and it already owns process-group setup, the launcher and collectives. What it leaves to the user,
parallelkit does: a mesh of any named axes instead of (data, tensor) only, the model's plan
applied with no `configure_model`, the data-parallel group everywhere Lightning asks for one, gradient
clipping across DTensor shards, no gradient communication on accumulation micro-steps, and FSDP2's own mixed
precision in place of autocast. Its DCP checkpoints are kept, made atomic and layout-independent.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Generator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from typing_extensions import override

from parallelkit.callbacks.activations import ActivationMemoryMonitor
from parallelkit.callbacks.comm import CommunicationMonitor
from parallelkit.callbacks.monitors import RankMonitor
from parallelkit.callbacks.preemption import PreemptionCheckpoint
from parallelkit.checkpoint import (
    check_compatible,
    load_meta,
    load_sharded,
    publish,
    read_metadata,
    remove,
    staging_path,
)
from parallelkit.comm import CommHook
from parallelkit.comm import resolve as resolve_comm_hook
from parallelkit.compat import (
    destroy_process_groups_at_exit,
    logging_a_step,
    quiet_root_view_warning,
    run_as_forward,
    saves_distributed_checkpoint,
    set_device_mesh,
    setup_distributed,
)
from parallelkit.errors import ConfigError
from parallelkit.grad_norm import clip_grad_norm_
from parallelkit.init import draw_whole_in_hooks, has_meta_tensors, materialize, meta_parameters
from parallelkit.lora import has_adapters, trainable_names
from parallelkit.mesh import AXES, MeshSpec
from parallelkit.optim import compile_step
from parallelkit.parallel import ResolvedPlan, resolve


def reduce_logged(tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
    """What Lightning's `Strategy.reduce` does with a `sync_dist` value (an all-reduce over `group`, in place; "mean"
    as SUM then a division on gloo, which has no AVG), without the barrier Lightning runs before it: a blocking
    round trip per logged value per step, which the all-reduce itself makes redundant."""
    import torch.distributed as dist

    if not isinstance(tensor, torch.Tensor) or not dist.is_available() or not dist.is_initialized():
        return tensor
    group = dist.group.WORLD if group is None else group
    divide = False
    if isinstance(reduce_op, str):
        name = "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
        divide = name == "avg" and dist.get_backend(group) == "gloo"
        reduce_op = dist.ReduceOp.SUM if divide else getattr(dist.ReduceOp, name.upper())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if reduce_op is None else reduce_op, group=group)
    if not divide:
        return tensor
    size = dist.get_world_size(group)
    return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)


def compile_backends() -> list[str]:
    """The backends `torch.compile` knows (inductor, aot_eager, eager, ...)."""
    return torch.compiler.list_backends(exclude_tags=())


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would build CPU kernels with, if there is one."""
    import os
    import shutil

    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((path for name in names if (path := shutil.which(name))), None)


MeshShape = str | Sequence[Any]
"""`[[sizes...], [axis names...]]`, as a list or a JSON string, or "auto"."""


FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
"""Optimizer state keyed per parameter name (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`): each rank saves
only its own parameters' entries, so a checkpoint loads under any layout. Unflattened, `param_groups` is one
list that DCP keeps from rank 0 only, and a pipeline stage 1 loading it finds none of its parameters."""

PRECISIONS = {"32-true": None, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16}
"""Trainer precisions a parallelkit strategy runs, with the dtype FSDP2 computes in (None: fp32)."""


class ShardedPrecision(Precision):
    """Precision for sharded models: FSDP2 casts parameters itself (no autocast), and gradient clipping by norm
    measures the global norm across every shard and stage."""

    def __init__(self, precision: str, stage_group: Any = None) -> None:
        if precision not in PRECISIONS:
            raise ConfigError(
                f"Trainer(precision={precision!r}) is not supported by parallelkit strategies; use one of "
                f"{', '.join(PRECISIONS)} (bf16-mixed computes in bf16 and keeps fp32 weights and gradients)."
            )
        self.precision = precision
        self.stage_group = stage_group

    @property
    def param_dtype(self) -> torch.dtype | None:
        return PRECISIONS[self.precision]

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(torch.bfloat16) if self.precision == "bf16-true" else module

    @override
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        clip_grad_norm_(self.main_params(optimizer), clip_val, stage_group=self.stage_group)


class ParallelkitStrategy(ModelParallelStrategy):
    """Base of parallelkit's strategies: the options every one of them (and every plugin built on them) takes.

    Args:
        mesh_shape: Sizes then axis names, outer to inner, e.g. `[[2, 2], ["fsdp", "tp"]]` (one size may be -1:
            the rest of the world); "auto": the subclass's default layout.
        reshard_after_forward: "default" (free gathered weights after each block's forward, except the last
            block and the root, which backward needs first), "always", or "never" (keep them: more memory,
            one all-gather fewer per block and step).
        sequence_parallel: Shard norms and the residual stream on the sequence dim inside the tp group.
            Default: on when tp > 1.
        loss_parallel: Compute the cross-entropy on vocab-sharded logits without gathering them (the
            model's loss must be `F.cross_entropy`, as in `pipeline_loss`). Only with tp > 1.
        activation_checkpointing: "none", "full" (recompute every block in backward) or an int n (every
            n-th block).
        compile: Compile each block (each fsdp unit) with `torch.compile`: true (inductor; on the CPU it needs a
            C++ compiler, else a warning and eager), false (eager, the default), or a backend name (e.g.
            "aot_eager"). Applied after tensor parallelism and activation checkpointing (traced inside each compiled
            block; not with tp > 1), before FSDP; parameter names are unchanged, so compiled and eager runs load
            each other's checkpoints.
        compile_optimizer: Compile the optimizer's update too (`parallelkit.optim.compile_step`; `compile`'s backend,
            inductor if that is off): one graph of fused kernels over the local shards instead of a dozen DTensor
            operations per parameter (AdamW, 4 x 256 GPT on two CPU processes: 10.4 -> 3.3 ms a step). Compiles at
            the first step (seconds to tens of seconds on the CPU); learning-rate schedules do not recompile it, and
            checkpoints are an eager optimizer's.
        cpu_offload: Keep sharded parameters, gradients and optimizer states in CPU memory (FSDP2; GPU runs).
        comm_precision: How gradients are reduced: a comm hook name ("fp32" default, "bf16", "fp16", "int8", or
            one a plugin registers) or a `parallelkit.comm.CommHook`.
        profile_communication: Log every collective per optimizer step (count, bytes, time by kind) and print
            a summary at the end of fit (`parallelkit.callbacks.CommunicationMonitor`).
        timeout: Seconds (or a timedelta) a collective may wait before the job fails instead of hanging.
        process_group_backend: "gloo" or "nccl"; default chosen from the accelerator.
        save_distributed_checkpoint: Each rank writes its shards (DCP); False: rank 0 gathers one plain file (for
            models that fit one process; any layout loads it, one plain process too).
        meta_init: Build the model's parameters on the meta device (the CLI and `Trainer.init_module()` do) and
            allocate only this rank's shards after sharding, so no process ever holds the whole model. Weights
            equal an eager build's from the same seed (`parallelkit.init`); the model must initialise through
            `reset_parameters()` of its modules and/or its own `init_weights()`.
    """

    required_axes: tuple[str, ...] = ("fsdp", "tp")
    """Axes always present in the built mesh (size 1 when the user's shape leaves them out)."""

    def __init__(
        self,
        mesh_shape: MeshShape = "auto",
        reshard_after_forward: Literal["default", "always", "never"] = "default",
        sequence_parallel: bool | None = None,
        loss_parallel: bool = False,
        activation_checkpointing: int | str = "none",  # int first: from the CLI "2" must parse as every 2nd block
        compile: bool | str = False,
        compile_optimizer: bool = False,
        cpu_offload: bool = False,
        comm_precision: str | CommHook | None = None,
        profile_communication: bool = False,
        timeout: float | timedelta = 1800.0,
        process_group_backend: str | None = None,
        save_distributed_checkpoint: bool = True,
        meta_init: bool = False,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout),
        )
        # Only stored: checked in _configure_launcher (LightningCLI would bury a constructor's error in its own).
        self.mesh_shape = mesh_shape
        self.mesh_spec: MeshSpec | None = None
        self.comm_precision = comm_precision
        self.comm_hook: CommHook | None = None
        self.profile_communication = profile_communication
        self.reshard_after_forward = reshard_after_forward
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.activation_checkpointing = activation_checkpointing
        self.compile = compile
        self.compile_optimizer = compile_optimizer
        self.cpu_offload = cpu_offload
        self.meta_init = meta_init

    # -- configuration, checked in the launching process before any worker starts --------------------------
    def check_options(self) -> None:
        """Validate the constructor's arguments (subclasses add theirs); raises ConfigError/MeshError."""
        if self.reshard_after_forward not in ("default", "always", "never"):
            raise ConfigError(
                f"reshard_after_forward={self.reshard_after_forward!r}: use 'default', 'always' or 'never'."
            )
        self.comm_hook = resolve_comm_hook(self.comm_precision)
        if self.compile not in (True, False) and self.compile not in compile_backends():
            raise ConfigError(
                f"compile={self.compile!r}: use true (torch.compile's inductor), false (eager), or a torch.compile "
                f"backend name: {', '.join(compile_backends())}."
            )
        if self.compile_optimizer not in (True, False):
            raise ConfigError(
                f"compile_optimizer={self.compile_optimizer!r}: use true (compile the optimizer's update with "
                "compile's backend, inductor when compile is false) or false."
            )

    @override
    def _configure_launcher(self) -> None:
        # Lightning calls this once it has given the strategy its devices, nodes and precision, and before it
        # launches: the last moment to fail fast on bad options or a mesh that does not fit, with no process
        # group yet.
        self.check_options()
        shape = self.auto_mesh(self.num_nodes, self.num_processes) if self.mesh_shape == "auto" else self.mesh_shape
        self.mesh_spec = self.full_mesh_spec(MeshSpec.parse(shape).resolve(self.num_nodes, self.num_processes))
        if not isinstance(self.precision_plugin, ShardedPrecision):
            self.precision_plugin = ShardedPrecision(self.precision_plugin.precision)
        inductor = "inductor" in (self.compile_backend(), self.optimizer_backend())
        if inductor and self.root_device.type == "cpu" and not cpp_compiler():
            options = {"compile": self.compile, "compile_optimizer": self.compile_optimizer}
            asked = " and ".join(f"{name}={value!r}" for name, value in options.items() if value)
            rank_zero_warn(
                f"{asked} on the CPU needs a C++ compiler for inductor's kernels, and none was found (g++, c++, "
                "clang++ or $CXX): training eager. Install one, or set compile: aot_eager to compile without it."
            )
            self.compile = self.compile_optimizer = False
        if self.cpu_offload and self.root_device.type == "cpu":
            raise ConfigError(
                "cpu_offload=True moves sharded state from accelerator memory to CPU memory, but this run already "
                "trains on the CPU. Set cpu_offload=False, or train on GPUs."
            )
        self.check_mesh_options()
        super()._configure_launcher()

    def check_mesh_options(self) -> None:
        """Options that depend on the mesh: checked before launch, and again if `mesh_shape="auto"` is planned."""
        tp = self.mesh_spec.size("tp")
        if self.compile_backend() and self.activation_checkpointing not in ("none", 0) and tp > 1:
            raise ConfigError(
                f"compile={self.compile!r} with activation_checkpointing={self.activation_checkpointing!r} on a tp "
                f"axis of {tp}: a compiled block recomputes its activations with torch.utils.checkpoint traced inside "
                "it, which torch 2.13 cannot do for tensor-parallel blocks (it saves their device mesh). Set "
                "activation_checkpointing='none', compile=false, or use a mesh without tp."
            )
        if self.loss_parallel and tp == 1:
            raise ConfigError(
                f"loss_parallel=True needs a tp axis larger than 1, but mesh_shape is {self.mesh_spec}. "
                "Set loss_parallel=False or add tp to the mesh."
            )

    def check_run(self, model: Any, datamodule: Any = None, accumulate_grad_batches: int = 1) -> None:
        """Refuse, before any worker starts, what this run cannot do with this model and data (default: what
        `check_model` refuses). The CLI calls it in the launching process; `setup` meets the same errors otherwise."""
        self.check_model(model)

    def check_model(self, model: Any) -> None:
        """Refuse a model this layout cannot split (e.g. tp not dividing its key/value heads) with a `PlanError`, by
        resolving its plan. The CLI calls it before any worker starts; `setup` resolves it again on every rank."""
        self.resolved = self.resolve_plan(model)

    resolved: ResolvedPlan | None = None
    """The model's plan resolved for this run's layout (`parallelkit.parallel.resolve`), once per process in `setup`
    (and before launch by `check_run`): what `parallelize`, the monitors and the pipeline schedule read. None for a
    model that overrides `configure_model()` and parallelises itself."""

    def resolve_plan(self, model: Any) -> ResolvedPlan | None:
        """`model`'s plan resolved for this layout (the tp degree, sequence and loss parallelism); None for a model
        that overrides `configure_model()` (`parallelize_model` leaves it as it made itself)."""
        if is_overridden("configure_model", model):
            return None
        return resolve(
            model,
            tp=self.mesh_spec.size("tp"),
            sequence_parallel=self.sequence_parallel,
            loss_parallel=self.loss_parallel,
        )

    def layout(self) -> dict[str, Any]:
        """The run's parallel layout: strategy, mesh and the size of every axis (1 where the mesh has none)."""
        spec = self.mesh_spec
        sizes = {f"{axis}_size": spec.size(axis) for axis in AXES}
        return {
            "strategy": type(self).__name__,
            "mesh_shape": str(spec),
            "world_size": spec.world_size,
            "dp_size": spec.dp_size,
            **sizes,
        }

    def auto_mesh(self, num_nodes: int, devices: int) -> MeshShape:
        """What `mesh_shape="auto"` means: every process shards (fully sharded data parallel)."""
        return [[-1], ["fsdp"]]

    def planned_mesh(self) -> MeshSpec | None:
        """The mesh `mesh_shape="auto"` resolves to once the model is known; None keeps `auto_mesh`'s."""
        return None

    @property
    def save_distributed_checkpoint(self) -> bool:
        """Whether checkpoints are sharded (a DCP directory, each rank writing its shards) or one file from rank 0."""
        return saves_distributed_checkpoint(self)

    def use_mesh(self, spec: MeshSpec) -> None:
        """Train on `spec` (a planned "auto" mesh) instead of the one resolved at construction."""
        self.mesh_spec = self.full_mesh_spec(spec.resolve(self.num_nodes, self.num_processes))
        self.check_mesh_options()

    def full_mesh_spec(self, spec: MeshSpec) -> MeshSpec:
        """`spec` with every required axis present, so code can always index `mesh["tp"]`, `mesh["fsdp"]`."""
        sizes = dict(zip(spec.names, spec.sizes))
        names = [axis for axis in AXES if axis in sizes or axis in self.required_axes]
        return MeshSpec(tuple(sizes.get(axis, 1) for axis in names), tuple(names))

    # -- process groups --------------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        setup_distributed(self)
        destroy_process_groups_at_exit()
        if self.mesh_shape == "auto":
            planned = self.planned_mesh()
            if planned is not None:
                self.use_mesh(planned)
        # The escape hatch: a model that overrides configure_model() parallelises itself with this mesh.
        set_device_mesh(self, self.mesh_spec.build(self.root_device.type))

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.mesh_spec.dp_size, "rank": self.mesh_spec.dp_rank(self.global_rank)}

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        return reduce_logged(tensor, group, reduce_op)

    # -- training-step hooks ---------------------------------------------------------------------------------
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-steps keep gradients local: no reduce-scatter / all-reduce until the last one."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self.model, FSDPModule):
            yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def loss_context(self) -> Any:
        """Context in which the model's loss runs, forward and backward: loss parallelism when asked for."""
        if not self.loss_parallel:
            return nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    # -- model setup -----------------------------------------------------------------------------------------
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Where `Trainer.init_module()` (and `configure_model()`) build the model: with `meta_init` (or
        `empty_init=True`) its parameters go to the meta device and are allocated, sharded, in `setup`."""
        meta = self.meta_init if empty_init is None else empty_init
        with meta_parameters() if meta else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    def compile_backend(self) -> str | None:
        """The `torch.compile` backend each block is compiled with, or None (eager)."""
        return "inductor" if self.compile is True else self.compile or None

    def optimizer_backend(self) -> str | None:
        """The `torch.compile` backend of the optimizer's update (`compile`'s, inductor when that is off), or None."""
        return (self.compile_backend() or "inductor") if self.compile_optimizer else None

    def parallelize_options(self) -> dict[str, Any]:
        """What every strategy passes to `parallelkit.parallelize`: the resolved plan and the per-block options."""
        return {
            "resolved": self.resolved,
            "activation_checkpointing": self.activation_checkpointing,
            "compile": self.compile_backend(),
            "reshard_after_forward": self.reshard_after_forward,
            "param_dtype": self.precision_plugin.param_dtype,
            "comm_hook": self.comm_hook,
            "cpu_offload": self.cpu_offload,
        }

    @abstractmethod
    def parallelize_model(self, trainer: Any) -> None:
        """Make `self.model` parallel over `self.device_mesh`."""

    @override
    def setup(self, trainer: Any) -> None:
        if self.profile_communication and not any(isinstance(c, CommunicationMonitor) for c in trainer.callbacks):
            trainer.callbacks.append(CommunicationMonitor())
        monitors = [
            type(c).__name__ for c in trainer.callbacks if isinstance(c, (RankMonitor, ActivationMemoryMonitor))
        ]
        if self.compile_backend() and monitors:
            rank_zero_warn(
                f"compile={self.compile!r}: {' and '.join(monitors)} count the activations saved for backward outside "
                "the compiled blocks only (embedding, head, loss); the blocks' own are not seen."
            )
        if not any(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks):
            trainer.callbacks.append(PreemptionCheckpoint())  # SIGTERM saves last.ckpt, then exits cleanly
        for logger in trainer.loggers:  # next to the model's hyperparameters, e.g. in a wandb run's config
            logger.log_hyperparams({"parallel": self.layout()})
        built = dict(self.model.named_modules())  # before a pipeline split drops other ranks' layers
        self._parameter_names = [name for name, _ in self.model.named_parameters()]
        self.resolved = self.resolve_plan(self.lightning_module)
        resolved, tp = self.resolved, self.mesh_spec.size("tp")
        if resolved is not None and self.sequence_parallel is None and tp > 1 and not resolved.sequence_parallel:
            rank_zero_info(
                f"sequence_parallel off: {type(self.lightning_module).__name__}'s tp_plan shards no norm on the "
                "sequence dim (no 'sequence_parallel' entry), so its activations stay whole on every tp rank."
            )
        self.parallelize_model(trainer)
        quiet_root_view_warning(self.model)
        if has_meta_tensors(self.model):
            materialize(self.model, torch.device("cpu") if self.cpu_offload else self.root_device, built)
        draw_whole_in_hooks(self.lightning_module)
        # The rest as any Lightning strategy does it (precision, device, optimizers). Not ModelParallelStrategy's
        # setup: it insists on a configure_model() and materialises meta tensors its own way.
        Strategy.setup(self, trainer)

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if self.optimizer_backend():
            for optimizer in self.optimizers:
                compile_step(optimizer, self.optimizer_backend())

    @override
    def model_to_device(self) -> None:
        if not self.cpu_offload:  # FSDP2's offload policy decides where sharded parameters live
            super().model_to_device()

    # -- checkpoints -----------------------------------------------------------------------------------------
    EXTRA_STATE_KEY = "strategy"
    """The DCP key that `extra_state()` is saved under: its entries appear as `strategy.<key>` in a checkpoint."""

    def extra_state(self) -> dict[str, Any]:
        """The strategy's own training state, to checkpoint next to the model and optimizers (default: none).

        A flat mapping of key -> tensor, DTensor, or small picklable value, asked of every rank when a full
        checkpoint is saved (not a weights-only one) and written through DCP with the model: each rank writes its
        DTensors' shards, and a key that several ranks give (a replicated tensor, the same shard) is written once, by
        one of them. So ranks whose values differ must give different keys; keys may differ from rank to rank. Key
        by parameter name, not by position, so that the state loads under another layout.
        """
        return {}

    def load_extra_state(self, read: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """Restore what `extra_state()` saved; runs after the model and optimizers are restored, so it may
        overwrite them (default: reads nothing).

        `read(template)` fills the template (key -> tensor or DTensor of the shape and layout wanted here, or any
        value standing for a non-tensor) in place from the checkpoint, resharding DTensors to the template's
        layout, and returns the entries the checkpoint held; a key it lacks (a checkpoint written by another
        strategy, or before that state existed) is left out of the result. `read` is collective: call it on every
        rank the same number of times (the templates may differ from rank to rank). Only sharded (DCP) checkpoints
        hold extra state; a single-file checkpoint does not, and this is not called for one.
        """

    # Rank 0's saves that wait for their step's logs, (staging, path), and the removals that wait for them,
    # (None, path), in the order ModelCheckpoint asked for them.
    _unpublished: tuple[tuple[Path | None, Path], ...] = ()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Save atomically: every rank writes under `<name>.partial`, and rank 0 renames it to `<name>` once all
        have finished, so a checkpoint under its final name is complete and a crash mid-save leaves the
        previous one (and `ckpt_path="last"`, which ignores `.partial`) intact.

        A checkpoint saved at the end of a training step (ModelCheckpoint's `every_n_train_steps`) is renamed only
        once Lightning has handed that step's metrics to the loggers, which it does after every batch-end hook: a run
        killed in between would otherwise leave `last` on a step its logs lack, and the relaunch would resume after
        it. So the logs of a run that survived faults have every step. The checkpoints ModelCheckpoint removes in that
        step (those the new one replaces) are removed after it is published (`remove_checkpoint`).

        "Handed to the loggers" is "on disk" here without a flush of ours: Lightning calls each logger's `save()` right
        after its `log_metrics()` (CSVLogger writes its rows then, whatever `flush_logs_every_n_steps` says; TensorBoard
        flushes its writer). A flush before the save could not help: the step's metrics are in no logger yet."""
        path = Path(self.broadcast(str(filepath)))
        staging = staging_path(path)
        logging = logging_a_step(self.lightning_module.trainer)
        if self.is_global_zero:
            if not logging:
                # Outside a step's end hooks, the step of any waiting save is logged (SIGTERM's `last.ckpt` comes
                # after it, before the next batch): publish those first, so that saves of one path land in order.
                self._publish_logged()
            remove(staging)  # left by a crashed save
        self.barrier()
        if self.save_distributed_checkpoint and storage_options is None:
            self._save_sharded(checkpoint, staging)
        else:
            if "optimizer_states" in checkpoint and self.extra_state():
                rank_zero_warn(
                    f"save_distributed_checkpoint=False: the single file holds the model and optimizers only, not "
                    f"{type(self).__name__}'s own state (extra_state), which a run resumed from it starts afresh. "
                    "Set save_distributed_checkpoint=True to keep it."
                )
            super().save_checkpoint(checkpoint, staging, storage_options)
        self.barrier()
        if self.is_global_zero:
            if logging:
                self._unpublished += ((staging, path),)
            else:
                publish(staging, path)
        self.barrier()

    def _save_sharded(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Write what Lightning's ModelParallelStrategy writes (the model as `state_dict` and each optimizer as
        `optimizer_<i>` through DCP, the loops' state to `meta.pt` by rank 0) plus `extra_state()` in the same DCP
        save, so that one `.metadata` describes all of it."""
        import torch.distributed.checkpoint as dcp

        path.mkdir(parents=True, exist_ok=True)
        rest = dict(checkpoint)
        full = "optimizer_states" in rest  # a weights-only checkpoint has none, and no training state at all
        sharded = {"state_dict": rest.pop("state_dict")}
        sharded.update({f"optimizer_{i}": state for i, state in enumerate(rest.pop("optimizer_states", []))})
        extra = self.extra_state() if full else {}
        if extra:
            sharded[self.EXTRA_STATE_KEY] = extra
        dcp.save(sharded, checkpoint_id=str(path))
        if self.global_rank == 0:
            torch.save(rest, path / "meta.pt")

    @property
    def adapters_only(self) -> bool:
        """Whether checkpoints hold the trainable parameters only: the model trains LoRA adapters on frozen base
        weights, which each run gets where the first one did (`pretrained`, or the seed)."""
        return has_adapters(self.lightning_module)

    def saved_parameters(self) -> list[str] | None:
        """The model's state-dict keys a checkpoint holds (None: all of them)."""
        return trainable_names(self.model) if self.adapters_only else None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        full = not self.save_distributed_checkpoint
        options = StateDictOptions(full_state_dict=full, cpu_offload=True, ignore_frozen_params=self.adapters_only)
        return get_model_state_dict(self.model, options=options)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if not self.save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer), options=FLAT)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        return self._load_sharded(path, weights_only) if path.is_dir() else self._load_single_file(path, weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        # ModelCheckpoint removes the checkpoint a save replaces (save_top_k, a renamed `last`) right after that save:
        # removed before the save is published, a kill in between would leave no checkpoint to resume from.
        if self._unpublished:
            self._unpublished += ((None, Path(filepath)),)
        else:
            super().remove_checkpoint(filepath)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # The loop logged the previous step before it starts this one (every batch comes here, `batch_to_device` not
        # when the training step takes the dataloader iterator).
        self._publish_logged()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def on_train_end(self) -> None:
        self._publish_logged()
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Lightning raises SIGTERMException once the step is logged, before the next batch starts: that step's saves
        # are published. An exception from inside a step's end hooks leaves them unpublished, as a kill there would.
        if self._unpublished and not logging_a_step(self.lightning_module.trainer):
            self._publish_logged()
        super().on_exception(exception)

    def _publish_logged(self) -> None:
        """Publish the checkpoints saved in the step whose metrics the loop has now logged, and make the removals that
        waited for them, in the order asked (see `save_checkpoint`). Rank 0's: every rank finished writing them during
        the save."""
        unpublished, self._unpublished = self._unpublished, ()
        for staging, path in dict.fromkeys(unpublished):  # a path saved twice in the step: once
            if staging is None:
                super().remove_checkpoint(path)
            else:
                publish(staging, path)

    def _load_sharded(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        saved = self.saved_parameters()
        check_compatible(self.model, path, names=saved)
        current = get_model_state_dict(self.model)
        state = {"state_dict": {k: v for k, v in current.items() if saved is None or k in saved}}
        load_sharded(state, path)
        strict = self.lightning_module.strict_loading
        set_model_state_dict(self.model, {**current, **state["state_dict"]}, options=StateDictOptions(strict=strict))
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            state = {key: get_optimizer_state_dict(self.model, optimizer, options=FLAT)}
            load_sharded(state, path)
            set_optimizer_state_dict(self.model, optimizer, state[key], options=FLAT)
        self.load_extra_state(self._extra_state_reader(path))
        return load_meta(path, weights_only=weights_only is not False)

    def _extra_state_reader(self, path: Path) -> Callable[[dict[str, Any]], dict[str, Any]]:
        """The `read` that `load_extra_state` gets for the DCP checkpoint at `path`."""
        saved = set(read_metadata(path).state_dict_metadata)
        prefix = f"{self.EXTRA_STATE_KEY}."

        def read(template: dict[str, Any]) -> dict[str, Any]:
            found = {key: value for key, value in template.items() if prefix + key in saved}
            # Every rank loads, even one that asks for nothing: DCP plans the load collectively.
            load_sharded({self.EXTRA_STATE_KEY: found}, path)
            return found

        return read

    def _load_single_file(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """Load a `save_distributed_checkpoint=False` file. Every rank maps it (mmap: only the pages it reads) and
        takes the parameters it holds; Lightning's own loader broadcasts every tensor from rank 0 instead, which
        fails when ranks hold different parameters (pipeline stages)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only is not False)
        weights = checkpoint.pop("state_dict")
        check_compatible(self.model, path, weights, names=self.saved_parameters())
        held = set(self.model.state_dict())
        options = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, {k: v for k, v in weights.items() if k in held}, options=options)
        # Left in the checkpoint: Lightning checks it is there before restoring (a no-op here) the optimizers.
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            state = self._keyed_by_name(state)
            groups = [{**group, "params": [p for p in group["params"] if p in held]} for group in state["param_groups"]]
            mine = {"state": {k: v for k, v in state["state"].items() if k in held}, "param_groups": groups}
            set_optimizer_state_dict(self.model, optimizer, mine, options=options)
        return checkpoint

    def _keyed_by_name(self, state: dict[str, Any]) -> dict[str, Any]:
        """An optimizer state keyed by parameter index, as a single file holds it (Lightning numbers parameters in
        the whole model's order so that one plain process can load it too), keyed by parameter name instead."""
        if not any(isinstance(p, int) for group in state["param_groups"] for p in group["params"]):
            return state
        names = self._parameter_names
        return {
            "state": {names[index]: value for index, value in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
        }

    def _in_root_forward(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run the LightningModule's `method` (training_step, ...) as the forward of its FSDP root.

        FSDP2 gathers a unit's parameters in the forward hooks of the module it shards, and the root unit is the
        LightningModule. A module that calls its network as a child (`self.model(x)`, or an encoder and a head in
        turn) never runs its own forward, so what the root holds (embeddings, final norm, head) would stay sharded.
        Lightning reroutes steps through a wrapper's forward for DDP and FSDP1 for this reason; FSDP2 shards the
        module in place, so here the module is its own wrapper. A step that calls `self(x)` runs the root's hooks
        a second time, inside the first, where they find the parameters already gathered.
        """
        from torch.distributed.fsdp import FSDPModule

        module = self.lightning_module
        if isinstance(module, FSDPModule):
            return run_as_forward(module, method, *args, **kwargs)
        return getattr(module, method)(*args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss_context(), self.precision_plugin.train_step_context():
            return self._in_root_forward("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss_context(), self.precision_plugin.val_step_context():
            return self._in_root_forward("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss_context(), self.precision_plugin.test_step_context():
            return self._in_root_forward("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._in_root_forward("predict_step", *args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.loss_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)
