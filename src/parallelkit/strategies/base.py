"""What every parallelkit strategy shares: the named mesh, data-parallel bookkeeping, precision and clipping.

`ParallelkitStrategy` subclasses Lightning's `ModelParallelStrategy` on purpose: that is Lightning's FSDP2/DTensor
strategy, and it already owns process-group setup, the launcher and collectives. What it leaves to the user,
parallelkit does: a mesh of any named axes instead of (data, tensor) only, the model's plan
applied with no `configure_model`, the data-parallel group everywhere Lightning asks for one, gradient
clipping across DTensor shards, no gradient communication on accumulation micro-steps, and FSDP2's own mixed
precision in place of autocast. Its DCP checkpoints are kept, made atomic and layout-independent.

This module keeps the Lightning lifecycle only: options checked before launch, the mesh, and the plan resolved and
applied in `setup`. How each step runs is `strategies/steps.py`, checkpoint I/O `parallelkit.checkpoint.strategy`,
precision `strategies/precision.py`, the parallel techniques `parallelkit.parallel` (docs/architecture.md).
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections.abc import Generator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from parallelkit.adapters.lora import quantize_base, unquantized
from parallelkit.callbacks.activations import ActivationMemoryMonitor
from parallelkit.callbacks.comm import CommunicationMonitor
from parallelkit.callbacks.monitors import RankMonitor
from parallelkit.callbacks.preemption import PreemptionCheckpoint
from parallelkit.callbacks.replicas import ReplicaMonitor
from parallelkit.checkpoint.strategy import FLAT, ShardedCheckpoints
from parallelkit.comm import CommHook
from parallelkit.comm import resolve as resolve_comm_hook
from parallelkit.compat import (
    destroy_process_groups_at_exit,
    model_class_name,
    process_group_backend,
    quiet_root_view_warning,
    saves_distributed_checkpoint,
    set_device_mesh,
    setup_distributed,
)
from parallelkit.errors import ConfigError, PlanError
from parallelkit.init import draw_whole_in_hooks, has_meta_tensors, materialize, meta_parameters
from parallelkit.mesh import AXES, MeshSpec
from parallelkit.parallel import DataParallelWrap, ResolvedPlan, data_parallel_wrap, resolve
from parallelkit.parallel.compile import compile_backends, cpp_compiler
from parallelkit.parallel.context_parallel import SequenceSplit
from parallelkit.parallel.replica_groups import ReplicaGroups
from parallelkit.strategies.precision import ShardedPrecision
from parallelkit.strategies.steps import ParallelSteps

__all__ = ["FLAT", "MeshShape", "ParallelkitStrategy", "ShardedPrecision"]
"""What plugins import from here (`FLAT` lives with the checkpoint I/O, `ShardedPrecision` with precision)."""

MeshShape = str | Sequence[Any]

"""`[[sizes...], [axis names...]]`, as a list or a JSON string, or "auto"."""

JOIN_TIMEOUT = timedelta(minutes=5)
"""The least time the ranks wait for each other to join the default process group, whatever `timeout` says."""


class ParallelkitStrategy(ParallelSteps, ShardedCheckpoints, ModelParallelStrategy):
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
        compile_optimizer: Compile the optimizer's update too (`parallelkit.optimizers.compiled.compile_step`;
            `compile`'s backend, inductor if that is off): one graph of fused kernels over the local shards instead
            of a dozen DTensor operations per parameter (AdamW, 4 x 256 GPT on two CPU processes: 10.4 -> 3.3 ms a
            step). AdamW, Adam and SGD are traced over the local shards themselves, others over the DTensors.
            Compiles at the second step (the first, eager, creates the state; seconds to tens of seconds on the
            CPU); learning-rate schedules do not recompile it, and checkpoints are an eager optimizer's.
        cpu_offload: Keep sharded parameters, gradients and optimizer states in CPU memory (FSDP2; GPU runs).
        comm_precision: How gradients are reduced: a comm hook name ("fp32" default, "bf16", "fp16", "int8", or
            one a plugin registers) or a `parallelkit.comm.CommHook`.
        profile_communication: Log every collective per optimizer step (count, bytes, time by kind) and print
            a summary at the end of fit (`parallelkit.callbacks.CommunicationMonitor`).
        timeout: Seconds (or a timedelta) a collective may wait before the job fails instead of hanging. Start-up is
            not a collective: the ranks wait for each other to join for at least `JOIN_TIMEOUT` (5 minutes).
        process_group_backend: "gloo" or "nccl"; default chosen from the accelerator.
        save_distributed_checkpoint: Each rank writes its shards (DCP); False: rank 0 gathers one plain file (for
            models that fit one process; any layout loads it, one plain process too).
        async_checkpoint: Sharded checkpoints saved at a step's end are written in the background: training goes on
            once the state is copied in memory; the checkpoint is published (renamed from `.partial`, seen by `last`)
            when every rank's write is complete. One write in flight at most (the next save waits for it); SIGTERM's
            save waits for it before its own. Costs a copy of the rank's state in memory while writing.
        cp_method: How attention crosses the `cp` axis's slices of each sequence: "allgather" (keys and values
            gathered, any head count) or "ulysses" (all-to-all over heads; heads divisible by cp).
        meta_init: Build the model's parameters on the meta device (the CLI and `Trainer.init_module()` do) and
            allocate only this rank's shards after sharding, so no process ever holds the whole model. Weights
            equal an eager build's from the same seed (`parallelkit.init`); the model must initialise through
            `reset_parameters()` of its modules and/or its own `init_weights()`.
        replica_groups: This job is one of several replica groups, launched separately, that train as one
            data-parallel job through torchft (`parallelkit.parallel.ReplicaGroups`: this group's index, their
            number, the lighthouse); the mesh is this group's own.
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
        async_checkpoint: bool = False,
        cp_method: str = "allgather",
        replica_groups: ReplicaGroups | None = None,
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
        self.data_parallel: DataParallelWrap | None = None  # what `parallelize` decided about FSDP, read in `setup`
        self._accumulating = False  # in block_backward_sync without FSDP: settled after the last micro-step
        self.profile_communication = profile_communication
        self.reshard_after_forward = reshard_after_forward
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.activation_checkpointing = activation_checkpointing
        self.compile = compile
        self.compile_optimizer = compile_optimizer
        self.cpu_offload = cpu_offload
        self.meta_init = meta_init
        self.async_checkpoint = async_checkpoint
        self.cp_method = cp_method
        self.replica_groups = replica_groups
        self.collective_timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)

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
        if self.async_checkpoint and not self.save_distributed_checkpoint:
            raise ConfigError(
                "async_checkpoint=True writes each rank's shards in the background, but save_distributed_checkpoint="
                "False gathers one file on rank 0. Set save_distributed_checkpoint=True, or async_checkpoint=False."
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
        if self.mesh_spec.cp_size > 1 and self.compile_backend() and self.activation_checkpointing not in ("none", 0):
            raise ConfigError(
                f"compile={self.compile!r} with activation_checkpointing={self.activation_checkpointing!r} on a mesh "
                f"with cp={self.mesh_spec.cp_size}: a compiled block runs its cp attention eagerly between two graphs, "
                "and inside a checkpointed block torch cannot break the graph there (it would train uncompiled). Fix: "
                "one of compile or activation_checkpointing."
            )
        if self.replica_groups is not None:
            self.replica_groups.check(self.mesh_spec)
        if self.loss_parallel and tp == 1:
            raise ConfigError(
                f"loss_parallel=True needs a tp axis larger than 1, but mesh_shape is {self.mesh_spec}. "
                "Set loss_parallel=False or add tp to the mesh."
            )

    def check_run(self, model: Any, datamodule: Any = None, accumulate_grad_batches: int = 1) -> None:
        """Refuse, before any worker starts, what this run cannot do with this model and data (default: what
        `check_model` refuses). The CLI calls it in the launching process; `setup` meets the same errors otherwise."""
        self.check_model(model)
        if self.mesh_spec.cp_size > 1 and getattr(datamodule, "seq_len", None) is not None:
            SequenceSplit(self.mesh_spec.cp_size, 0).check(datamodule.seq_len)

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
            if self.mesh_spec.cp_size > 1:
                raise PlanError(
                    f"mesh_shape has cp={self.mesh_spec.cp_size}, but {type(model).__name__} parallelises itself in "
                    "configure_model(), where no slice of the sequence is attended across. Fix: a mesh without cp."
                )
            return None
        return resolve(
            model,
            tp=self.mesh_spec.size("tp"),
            ep=self.mesh_spec.size("ep"),
            cp=self.mesh_spec.cp_size,
            cp_method=self.cp_method,
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
        if process_group_backend(self) == "nccl":  # torch's flight recorder: each rank's trace dumped on a timeout
            os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
            os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        # The rendezvous waits out the ranks' start-up skew (imports, a slow node), which a short collective timeout
        # would turn into a crash; the default group's collectives then get the user's timeout.
        setup_distributed(self, join_timeout=JOIN_TIMEOUT)
        destroy_process_groups_at_exit()
        if self.mesh_shape == "auto":
            planned = self.planned_mesh()
            if planned is not None:
                self.use_mesh(planned)
        # The escape hatch: a model that overrides configure_model() parallelises itself with this mesh.
        set_device_mesh(self, self.mesh_spec.build(self.root_device.type, self.collective_timeout))

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
            "prepare": self.quantize_base,
        }

    def quantize_base(self, root: Any) -> None:
        """QLoRA (`lora.quantize_base`): the adapted layers' base weights stored as NF4 before FSDP shards them; a
        meta-built weight from the model's `base_weight(name)` (HFCausalLM reads it from `pretrained`)."""
        module = self.lightning_module
        read = getattr(module, "base_weight", None)
        if not unquantized(root):
            return
        name = next((n for n, m in module.named_modules() if m is root), "")  # a unit or a stage: its FQN
        quantize_base(root, read, self.root_device, prefix=f"{name}." if name else "")
        waiting = [name for name, weight in unquantized(root) if weight.is_meta]
        if waiting:
            raise ConfigError(
                f"lora.quantize_base: nf4 with meta_init needs each base weight's values before sharding, to quantize "
                f"them; {model_class_name(self.lightning_module)} gives none for {waiting[0]} (only "
                "HFCausalLM with model.pretrained reads them). Fix: meta_init: false (the model is built with its "
                "weights and quantized at once), or load pretrained weights."
            )

    def axes_out_of_sync(self) -> set[str]:
        """Mesh axes along which ranks' replicated parameters may differ right now (`ReplicaMonitor` skips them): none
        for a strategy that keeps its replicas equal after every step."""
        return set()

    @abstractmethod
    def parallelize_model(self, trainer: Any) -> None:
        """Make `self.model` parallel over `self.device_mesh`."""

    def default_callbacks(self) -> list[Any]:
        """Callbacks `setup` adds to the trainer's unless it has one of the same class: `PreemptionCheckpoint`
        (SIGTERM saves last.ckpt, then exits cleanly), `ReplicaMonitor` (replicated parameters compared across ranks
        every 100 steps) and `CommunicationMonitor` with `profile_communication`."""
        callbacks: list[Any] = [PreemptionCheckpoint(), ReplicaMonitor()]
        if self.profile_communication:
            callbacks.insert(0, CommunicationMonitor())
        return callbacks

    @override
    def setup(self, trainer: Any) -> None:
        if self.mesh_spec.cp_size > 1 and trainer.predicting:
            raise ConfigError(
                f"predict on mesh_shape {self.mesh_spec}: each cp rank holds a slice of every sequence, and its "
                "predictions would be that slice's. Fix: predict on a mesh without cp (the checkpoint loads in any)."
            )
        for callback in self.default_callbacks():
            if not any(isinstance(c, type(callback)) for c in trainer.callbacks):
                trainer.callbacks.append(callback)
        monitors = [
            type(c).__name__ for c in trainer.callbacks if isinstance(c, (RankMonitor, ActivationMemoryMonitor))
        ]
        if self.compile_backend() and monitors:
            rank_zero_warn(
                f"compile={self.compile!r}: {' and '.join(monitors)} count the activations saved for backward outside "
                "the compiled blocks only (embedding, head, loss); the blocks' own are not seen."
            )
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
        self.data_parallel = data_parallel_wrap(self.model)
        quiet_root_view_warning(self.model)
        if has_meta_tensors(self.model):
            materialize(self.model, torch.device("cpu") if self.cpu_offload else self.root_device, built)
        draw_whole_in_hooks(self.lightning_module)
        # The rest as any Lightning strategy does it (precision, device, optimizers). Not ModelParallelStrategy's
        # setup: it insists on a configure_model() and materialises meta tensors its own way.
        Strategy.setup(self, trainer)
        self.join_replica_groups()

    @override
    def model_to_device(self) -> None:
        if not self.cpu_offload:  # FSDP2's offload policy decides where sharded parameters live
            super().model_to_device()
