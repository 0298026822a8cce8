"""`fsdp_tp`: FSDP2 x tensor parallelism over a named mesh, applied from the model's declared plan."""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from parallelkit.errors import ConfigError
from parallelkit.mesh import MeshSpec
from parallelkit.parallel import parallelize
from parallelkit.strategies.base import MeshShape, ParallelkitStrategy
from parallelkit.strategies.reference import build_reference, wanted_reference

_NOT_PLANNED = object()
"""`FSDPTPStrategy._auto_plan` before `plan_auto_mesh` has run (its result may be None: every process shards)."""


class FSDPTPStrategy(ParallelkitStrategy):
    """Hybrid FSDP2 x tensor parallel training over a named device mesh, with no hand-written model code.

    The model's `tp_plan` is applied on the `tp` axis, then each of its `fsdp_units` and the root are fully
    sharded over the data-parallel axes (`fsdp`, or `replicate` x `fsdp` = HSDP). A model that overrides
    `configure_model()` parallelises itself with `self.device_mesh` instead.

    Args:
        mesh_shape: Sizes then axis names, outer to inner, e.g. `[[2, 2], ["fsdp", "tp"]]` (one size may be -1:
            the rest of the world). Axes: replicate, fsdp, tp. "auto": the layout `parallelkit plan` recommends
            for this model, data and machine (logged at start; every process shards if the model cannot be
            planned; a model that fits no layout is refused before launch, with the shortfall and the fix).
        **kwargs: The options every parallelkit strategy takes (`ParallelkitStrategy`).
    """

    _auto_plan: Any = _NOT_PLANNED

    device_memory: float | None = None
    """Bytes per device `mesh_shape="auto"` is planned against: None for the device's own (a GPU's) or this machine's
    memory shared by its processes (CPU); `parallelkit check --dry-run --device-memory` sets the cluster's."""

    memory_headroom: float | None = None
    """The share of each device's memory `mesh_shape="auto"` leaves free: None for the planner's default
    (`planner.MEMORY_HEADROOM`, as `parallelkit plan`); `parallelkit check --dry-run --memory-headroom` sets it."""

    @override
    def setup(self, trainer: Any) -> None:
        reference = wanted_reference(self.lightning_module)  # preference tuning's frozen copy, still whole
        super().setup(trainer)
        if reference is None:
            return
        if self.resolved is None:
            raise ConfigError(
                f"{type(self.lightning_module).__name__} parallelises itself in configure_model(), so its frozen "
                "reference cannot be parallelised as it. Fix: LoRA (reference: adapters), or the model's declared plan."
            )
        build_reference(self, reference, parallelize)

    def parallelize_model(self, trainer: Any) -> None:
        # The escape hatch: a model overriding configure_model() has already parallelised itself there.
        if self.resolved is not None:
            parallelize(self.model, self.device_mesh, **self.parallelize_options())

    @override
    def check_run(self, model: Any, datamodule: Any = None, accumulate_grad_batches: int = 1) -> None:
        """Plan `mesh_shape="auto"` here, in the one launching process: a model that fits no layout is refused
        before any worker starts, and one that fits is checked against the planned mesh."""
        if self.plans_auto_mesh:
            planned = self.plan_auto_mesh(model, datamodule, accumulate_grad_batches)
            if planned is not None:
                self.use_mesh(MeshSpec.parse(planned))
        super().check_run(model, datamodule, accumulate_grad_batches)

    @property
    def plans_auto_mesh(self) -> bool:
        """Whether "auto" is the planner's choice. A subclass that defines its own `auto_mesh` (HSDP, DiLoCo) means
        that layout by "auto" and is not planned."""
        return self.mesh_shape == "auto" and type(self).auto_mesh is FSDPTPStrategy.auto_mesh

    def planned_mesh(self) -> MeshSpec | None:
        """`parallelkit plan`'s recommendation among fsdp/tp/hsdp meshes, decided on rank 0 (planned before launch
        when the CLI started the run) and broadcast: every rank must build the same mesh, even on nodes whose memory
        differs. A model that fits no layout is every rank's ConfigError."""
        if not self.plans_auto_mesh:
            return None
        choice: list[str | None] = [None, None]  # the mesh, or the error
        if self.global_rank == 0:
            trainer = self.lightning_module.trainer
            try:
                choice[0] = self.plan_auto_mesh(
                    self.lightning_module, trainer.datamodule, trainer.accumulate_grad_batches
                )
            except ConfigError as err:
                choice[1] = str(err)
        torch.distributed.broadcast_object_list(choice, src=0)
        if choice[1] is not None:
            raise ConfigError(choice[1])
        return MeshSpec.parse(choice[0]) if choice[0] else None

    def plan_auto_mesh(self, model: Any, datamodule: Any, accumulate_grad_batches: int) -> str | None:
        """The planner's mesh for this model, data and machine (once per process), None to keep every process
        sharding (a model the planner cannot see), or a ConfigError when no layout fits."""
        if self._auto_plan is _NOT_PLANNED:
            self._auto_plan = self._plan(model, datamodule, accumulate_grad_batches)
        return self._auto_plan

    def _plan(self, model: Any, datamodule: Any, accumulate_grad_batches: int) -> str | None:
        from parallelkit.memory import gb
        from parallelkit.planner import Hardware, recommend, workload

        if is_overridden("configure_model", model):
            rank_zero_info(
                f"mesh_shape='auto': {type(model).__name__} parallelises itself in configure_model(), which the "
                "planner cannot see; every process shards."
            )
            return None
        try:
            with torch.device("meta"):
                # LightningCLI records `_class_path` and the like among hparams: not constructor arguments.
                meta = type(model)(**{k: v for k, v in model.hparams.items() if not k.startswith("_")})
        except Exception as err:  # noqa: BLE001 - a model the planner cannot rebuild keeps the default mesh
            rank_zero_warn(
                f"mesh_shape='auto': cannot rebuild {type(model).__name__} from its hparams on the meta "
                f"device to plan it ({err}); every process shards."
            )
            return None
        work = workload(
            datamodule, self.precision_plugin.precision, self.activation_checkpointing, accumulate_grad_batches
        )
        if work is None:
            rank_zero_warn(
                "mesh_shape='auto': the datamodule states no seq_len/batch_size to plan for; every process shards."
            )
            return None
        elsewhere = ""
        if self.device_memory is not None:
            memory, hw = self.device_memory, {}
            budget = f"{gb(memory)} per device (--device-memory)"
        elif self.root_device.type == "cuda":
            memory, hw = torch.cuda.get_device_properties(self.root_device).total_memory, {}
            budget = f"{gb(memory)} per GPU"
        else:  # processes share the machine's memory; gloo moves a few GB/s, a core computes ~0.1 TFLOP/s
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / self.num_processes
            hw = {"intra_node_gbps": 5.0, "inter_node_gbps": 1.0, "device_tflops": 0.1}
            budget = f"{gb(memory)} per process (this machine's memory over {self.num_processes} processes)"
            elsewhere = (
                " For a cluster's devices: parallelkit check --dry-run --device-memory 80GB (their memory), or `plan`."
            )
        if self.memory_headroom is not None:
            hw["memory_headroom"] = self.memory_headroom
        hardware = Hardware(self.num_nodes, self.num_processes, memory, **hw)
        try:
            _, best, reason = recommend(meta, work, hardware, pipeline=False)
        except Exception as err:  # noqa: BLE001 - e.g. a module without forward(); the default mesh still trains
            rank_zero_warn(f"mesh_shape='auto': cannot plan {type(model).__name__} ({err}); every process shards.")
            return None
        if best is None:
            raise ConfigError(
                f"mesh_shape='auto': {type(model).__name__} fits no layout of {self.num_nodes} x {self.num_processes} "
                f"processes with {budget}, so nothing was launched: {reason} Or give the mesh yourself: "
                f"--trainer.strategy.mesh_shape='[[...], [...]]'.{elsewhere}"
            )
        rank_zero_info(f"mesh_shape='auto' -> {best.mesh}: {reason}")
        return best.mesh


class HSDPStrategy(FSDPTPStrategy):
    """FSDPTPStrategy whose "auto" mesh replicates across nodes and shards within each node (HSDP)."""

    def auto_mesh(self, num_nodes: int, devices: int) -> MeshShape:
        return [[num_nodes, devices], ["replicate", "fsdp"]]
