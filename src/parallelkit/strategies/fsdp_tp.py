"""`fsdp_tp`: FSDP2 x tensor parallelism over a named mesh, applied from the model's declared plan."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden

from parallelkit.errors import ConfigError
from parallelkit.plan import parallelize
from parallelkit.strategies.base import MeshShape, ParallelkitStrategy


class FSDPTPStrategy(ParallelkitStrategy):
    """Hybrid FSDP2 x tensor parallel training over a named device mesh, with no hand-written model code.

    The model's `tp_plan` is applied on the `tp` axis, then each of its `fsdp_units` and the root are fully
    sharded over the data-parallel axes (`fsdp`, or `replicate` x `fsdp` = HSDP). A model that overrides
    `configure_model()` parallelises itself with `self.device_mesh` instead.

    Args:
        mesh_shape: Sizes then axis names, outer to inner, e.g. `[[2, 2], ["fsdp", "tp"]]` (one size may be -1:
            the rest of the world). Axes: replicate, fsdp, tp. "auto": every process shards.
        reshard_after_forward: "default" (free gathered weights after each block's forward, except the last
            block and the root, which backward needs first), "always", or "never" (keep them: more memory,
            one all-gather fewer per block and step).
        sequence_parallel: Shard norms and the residual stream on the sequence dim inside the tp group.
            Default: on when tp > 1.
        loss_parallel: Compute the cross-entropy on vocab-sharded logits without gathering them (the
            model's loss must be `F.cross_entropy`, as in `pipeline_loss`). Only with tp > 1.
        activation_checkpointing: "none", "full" (recompute every block in backward) or an int n (every
            n-th block).
        cpu_offload: Keep sharded parameters, gradients and optimizer states in CPU memory (FSDP2).
        comm_precision: Gradient communication precision; only "fp32" in this version.
        timeout: Seconds (or a timedelta) a collective may wait before the job fails instead of hanging.
        process_group_backend: "gloo" or "nccl"; default chosen from the accelerator.
        save_distributed_checkpoint: Each rank writes its shards (DCP) instead of rank 0 a single file.
    """

    def __init__(
        self,
        mesh_shape: MeshShape = "auto",
        reshard_after_forward: Literal["default", "always", "never"] = "default",
        sequence_parallel: bool | None = None,
        loss_parallel: bool = False,
        activation_checkpointing: str | int = "none",
        cpu_offload: bool = False,
        comm_precision: str | None = None,
        timeout: float | timedelta = 1800.0,
        process_group_backend: str | None = None,
        save_distributed_checkpoint: bool = True,
    ) -> None:
        super().__init__(
            mesh_shape=mesh_shape,
            comm_precision=comm_precision,
            timeout=timeout,
            process_group_backend=process_group_backend,
            save_distributed_checkpoint=save_distributed_checkpoint,
        )
        if reshard_after_forward not in ("default", "always", "never"):
            raise ConfigError(f"reshard_after_forward={reshard_after_forward!r}: use 'default', 'always' or 'never'.")
        self.reshard_after_forward = reshard_after_forward
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.activation_checkpointing = activation_checkpointing
        self.cpu_offload = cpu_offload

    @property
    def tp_size(self) -> int:
        return self.mesh_spec.size("tp")

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self.cpu_offload and self.root_device.type == "cpu":
            raise ConfigError(
                "cpu_offload=True moves sharded state from accelerator memory to CPU memory, but this run already "
                "trains on the CPU. Set cpu_offload=False, or train on GPUs."
            )
        if self.loss_parallel and self.tp_size == 1:
            raise ConfigError(
                f"loss_parallel=True needs a tp axis larger than 1, but mesh_shape is {self.mesh_spec}. "
                "Set loss_parallel=False or add tp to the mesh."
            )

    def loss_context(self) -> Any:
        if not self.loss_parallel:
            return super().loss_context()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def setup(self, trainer: Any) -> None:
        from lightning.fabric.strategies.model_parallel import _materialize_distributed_module
        from lightning.fabric.utilities.optimizer import _optimizers_to_device

        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if is_overridden("configure_model", self.lightning_module):
            # The escape hatch: configure_model() already parallelised the model with self.device_mesh.
            _materialize_distributed_module(self.model, self.root_device)
        else:
            parallelize(
                self.model,
                self.device_mesh,
                sequence_parallel=self.tp_size > 1 if self.sequence_parallel is None else self.sequence_parallel,
                loss_parallel=self.loss_parallel,
                activation_checkpointing=self.activation_checkpointing,
                reshard_after_forward=self.reshard_after_forward,
                param_dtype=self.precision_plugin.param_dtype,
                cpu_offload=self.cpu_offload,
            )
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def model_to_device(self) -> None:
        if not self.cpu_offload:  # FSDP2's offload policy decides where sharded parameters live
            super().model_to_device()


class HSDPStrategy(FSDPTPStrategy):
    """FSDPTPStrategy whose "auto" mesh replicates across nodes and shards within each node (HSDP)."""

    def auto_mesh(self, num_nodes: int, devices: int) -> MeshShape:
        return [[num_nodes, devices], ["replicate", "fsdp"]]
