"""Lightning's DDP with a parallelkit comm hook, on any device."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from typing_extensions import override

from parallelkit.callbacks.comm import CommunicationMonitor
from parallelkit.callbacks.preemption import PreemptionCheckpoint
from parallelkit.comm import CommHook
from parallelkit.comm import resolve as resolve_comm_hook
from parallelkit.compat import destroy_process_groups_at_exit
from parallelkit.errors import ConfigError
from parallelkit.parallel.replica_groups import ReplicaGroups
from parallelkit.strategies.replica_steps import ReplicaGroupSteps


class DDPStrategy(ReplicaGroupSteps, LightningDDPStrategy):
    """Lightning's DDP (replicated model, gradients all-reduced in buckets) with a parallelkit comm hook.

    Lightning registers DDP communication hooks on CUDA only; this strategy registers the hook's DDP form on
    every device, so `comm_precision` means the same on CPU (gloo) as on GPUs.

    Args:
        comm_precision: "fp32" (default), "bf16", "fp16", a plugin's hook name, or a `CommHook` that has a DDP
            form (`ddp_hook()`; the int8 hook has none).
        profile_communication: Log every collective per optimizer step (`parallelkit.callbacks.CommunicationMonitor`).
        timeout: Seconds (or a timedelta) a collective may wait before the job fails instead of hanging.
        process_group_backend: "gloo" or "nccl"; default chosen from the accelerator.
        replica_groups: This job is one of several replica groups that train as one data-parallel job through
            torchft (`parallelkit.parallel.ReplicaGroups`), each group's ranks a DDP of their own.
        **kwargs: Passed to Lightning's DDPStrategy (and on to DistributedDataParallel).
    """

    def __init__(
        self,
        comm_precision: str | CommHook | None = None,
        profile_communication: bool = False,
        timeout: float | timedelta = 1800.0,
        process_group_backend: str | None = None,
        replica_groups: ReplicaGroups | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            timeout=timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout),
            process_group_backend=process_group_backend,
            **kwargs,
        )
        self.comm_precision = comm_precision
        self.comm_hook: CommHook | None = None
        self.profile_communication = profile_communication
        self.replica_groups = replica_groups

    @override
    def _configure_launcher(self) -> None:
        if self.replica_groups is not None:
            self.replica_groups.check(None)
        self.comm_hook = resolve_comm_hook(self.comm_precision)
        if self.comm_hook.ddp_hook() is None:
            raise ConfigError(
                f"comm_precision={self.comm_precision!r} has no DDP form (it replaces FSDP's reduce-scatter). "
                "Use fp32, bf16 or fp16 with DDP, or an FSDP layout (strategy='fsdp_tp') for this hook."
            )
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        destroy_process_groups_at_exit()

    @override
    def setup(self, trainer: Any) -> None:
        if self.profile_communication and not any(isinstance(c, CommunicationMonitor) for c in trainer.callbacks):
            trainer.callbacks.append(CommunicationMonitor())
        # As every parallelkit strategy: SIGTERM (preemption, SLURM, torchrun) saves last.ckpt and exits cleanly.
        # Lightning's own handler would stop the run without a checkpoint.
        if not any(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks):
            trainer.callbacks.append(PreemptionCheckpoint())
        super().setup(trainer)
        self.join_replica_groups()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.training_across_groups():
            return super().training_step(*args, **kwargs)

    @override
    def _register_ddp_hooks(self) -> None:
        self.model.register_comm_hook(state=None, hook=self.comm_hook.ddp_hook())
