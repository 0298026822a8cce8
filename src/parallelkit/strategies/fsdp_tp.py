"""`fsdp_tp`: FSDP2 x tensor parallelism over a named mesh, applied from the model's declared plan."""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.model_parallel import _materialize_distributed_module
from lightning.pytorch.utilities.model_helpers import is_overridden

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
        cpu_offload: Keep sharded parameters, gradients and optimizer states in CPU memory (FSDP2; GPU runs).
        comm_precision: How gradients are reduced: a comm hook name ("fp32" default, "bf16", "fp16", "int8", or
            one a plugin registers) or a `parallelkit.comm.CommHook`.
        profile_communication: Log every collective per optimizer step (count, bytes, time by kind) and print
            a summary at the end of fit (`parallelkit.callbacks.CommunicationMonitor`).
        timeout: Seconds (or a timedelta) a collective may wait before the job fails instead of hanging.
        process_group_backend: "gloo" or "nccl"; default chosen from the accelerator.
        save_distributed_checkpoint: Each rank writes its shards (DCP) instead of rank 0 a single file.
    """

    def parallelize_model(self, trainer: Any) -> None:
        if is_overridden("configure_model", self.lightning_module):
            # The escape hatch: configure_model() already parallelised the model with self.device_mesh.
            _materialize_distributed_module(self.model, self.root_device)
        else:
            parallelize(self.model, self.device_mesh, **self.parallelize_options())


class HSDPStrategy(FSDPTPStrategy):
    """FSDPTPStrategy whose "auto" mesh replicates across nodes and shards within each node (HSDP)."""

    def auto_mesh(self, num_nodes: int, devices: int) -> MeshShape:
        return [[num_nodes, devices], ["replicate", "fsdp"]]
