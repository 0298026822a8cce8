"""How each step runs on the parallel model: the Lightning step hooks of a parallelkit strategy.

`ParallelSteps` is mixed into `ParallelkitStrategy` ahead of `ShardedCheckpoints` and Lightning's
`ModelParallelStrategy`, whose step hooks it overrides: every step runs as the forward of the FSDP root, inside loss
parallelism when asked for; gradients are held back on accumulation micro-steps; and what leaving FSDP out asks of
the strategy (the model's `DataParallelWrap`, read in `setup`: gradients settled after each backward, plain tensors
replicated in the optimizer's update) is done here; under context parallelism each batch reaches the step as this
rank's slice of its sequences; under replica groups each step has its quorum, its gradients averaged across the
step's groups and its commit, and a group joins the others between a checkpoint's restore and its training state's
(`parallelkit.parallel.replica_groups`). The strategy keeps the Lightning lifecycle, this the steps.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from parallelkit.comm import reduce_logged
from parallelkit.compat import (
    before_training_state_restored,
    loaded_training_position,
    restore_training_position,
    rng_states,
    run_as_forward,
    set_rng_states,
    training_position,
)
from parallelkit.contract import is_preference_batch
from parallelkit.errors import ConfigError
from parallelkit.mesh import stage_group
from parallelkit.optimizers.compiled import compile_step, mixes_plain_and_dtensors, replicate_plain_tensors
from parallelkit.optimizers.grad_norm import settle_gradients
from parallelkit.optimizers.muon import Muon
from parallelkit.parallel.context_parallel import SequenceSplit, split_batch
from parallelkit.parallel.replica_groups import CommitGate, GroupState, ReplicaGroup, describe_layout


class ParallelSteps:
    """The step hooks of a parallelkit strategy (see the module's docstring); they read the strategy's `model`,
    `lightning_module`, `precision_plugin`, `loss_parallel`, `data_parallel` and `optimizer_backend()`."""

    @override
    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        """The batch on this rank's device; with a cp axis, this rank's slice of its sequences as a token batch
        (`parallelkit.parallel.context_parallel.split_batch`), every stage's steps then taking it alike."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        spec = self.mesh_spec
        if spec is None or spec.cp_size == 1:
            return batch
        split = SequenceSplit(spec.cp_size, spec.coordinates(self.global_rank)["cp"])
        trainer = self.lightning_module.trainer
        accumulated = trainer.accumulate_grad_batches if trainer.training else 1  # a step's batches
        return split_batch(batch, split, spec.dp_size * accumulated)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-steps keep gradients local: no reduce-scatter / all-reduce until the last one."""
        if not self.data_parallel.fsdp:
            self._accumulating = True  # pending sums add up until the last micro-step settles them
            try:
                yield
            finally:
                self._accumulating = False
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

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            if isinstance(optimizer, Muon):  # its matrices by name, gathered among the ranks of this stage
                if self.optimizer_backend():
                    raise ConfigError(
                        "compile_optimizer with parallelkit.Muon: its step sends shards of each matrix between "
                        "ranks, which torch.compile does not trace. Fix: compile_optimizer: false."
                    )
                optimizer.split(self.lightning_module, stage_group(self.device_mesh))
            if self.optimizer_backend():
                compile_step(optimizer, self.optimizer_backend())
            if self.data_parallel.replicate_plain_tensors and mixes_plain_and_dtensors(optimizer):
                replicate_plain_tensors(optimizer)

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

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.data_parallel.settle_gradients and not self._accumulating:
            settle_gradients(self.model)

    # -- replica groups (`parallelkit.parallel.replica_groups`): data parallelism across separately launched groups --
    replica_group: ReplicaGroup | None = None
    _in_training_step = False
    _restored_torchft: dict[str, int] | None = None  # torchft's state in the checkpoint this run resumes from

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """A logged value's `sync_dist` reduction, over `group` (default: every rank); under replica groups, a value
        logged in the training step across the step's groups too: `train_loss` is the job's, as one process's."""
        reduced = reduce_logged(tensor, group, reduce_op)
        if self.replica_group is None or not self._in_training_step:
            return reduced
        return self.replica_group.reduce(reduced, reduce_op)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """This rank's share of each global batch: among the mesh's data-parallel ranks, and under replica groups
        among every group's (group g's ranks take the shares after those of groups 0..g-1)."""
        spec, groups = self.mesh_spec, self.replica_groups
        size, rank = spec.dp_size, spec.dp_rank(self.global_rank)
        if groups is not None:
            size, rank = size * groups.num_groups, groups.group * size + rank
        return {"num_replicas": size, "rank": rank}

    def join_replica_groups(self) -> None:
        """Under `replica_groups`, this rank's torchft manager (heartbeating to the lighthouse from here on), and the
        first quorum once the checkpoint this run resumes from (if any) has given the model, optimizers and training
        position (`_join`)."""
        if self.replica_groups is None:
            return
        trained = {name: p for name, p in self.model.named_parameters() if p.requires_grad}  # sharded by now
        state = GroupState(describe_layout(self.world_size, self.mesh_spec, trained), trained, self.optimizers)
        self.replica_group = ReplicaGroup(self.replica_groups, self.global_rank, self.world_size, state)
        before_training_state_restored(self.lightning_module.trainer, self._join)

    def _join(self) -> None:
        """The group's first quorum, at the committed step the run starts from (0 or its checkpoint's): a group
        behind the others takes one's model, optimizers and training position here."""
        trainer, group = self.lightning_module.trainer, self.replica_group
        loaded = loaded_training_position(trainer)
        restored = self._restored_torchft or {}
        step = restored.get("step", loaded.get("global_step", 0))
        position = loaded or {**training_position(trainer), "rng": rng_states()}
        healed = group.join(step, restored.get("batches_committed", 0), position)
        if healed is not None:
            rng = healed.pop("rng", None)
            restore_training_position(trainer, healed)
            if rng is not None:
                set_rng_states(rng)
        rank_zero_info(
            f"replica group {self.replica_groups.group}: joined groups {list(group.groups)} at step "
            f"{group.committed_steps}" + (", copying their state" if healed is not None else "")
        )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.replica_group is None:
            return
        if isinstance(batch, Mapping) and "num_targets" in batch:
            raise ConfigError(
                "replica_groups with token batches (SFT or packed data: a loss divided by the step's target count): "
                "the count is the whole job's, and the groups that take part vary from step to step; not done yet. "
                "Fix: train replica groups on fixed-length windows (parallelkit.data.TextDataModule)."
            )
        if is_preference_batch(batch):
            raise ConfigError(
                "replica_groups with preference pairs (model.preference): the metrics and the NLL term's count are "
                "one group's, and a healing group's frozen reference is not checked; not done yet. Fix: train "
                "preference tuning without replica_groups."
            )
        position = {**training_position(self.lightning_module.trainer), "rng": rng_states()}
        self.replica_group.start_step(position)  # what a group joining in this step's quorum copies

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._in_training_step = True
        try:
            with self.loss_context(), self.precision_plugin.train_step_context():
                return self._in_root_forward("training_step", *args, **kwargs)
        finally:
            self._in_training_step = False

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Under replica groups: the closure's gradients averaged across the step's groups before the loop clips
        them, and the optimizer stepped only if the step commits (`CommitGate`); what the quorum was, logged."""
        group = self.replica_group
        if group is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def averaged() -> Any:
            result = closure()
            group.average_gradients(list(group.state.parameters.values()))
            return result

        result = super().optimizer_step(CommitGate(optimizer, group), averaged, model, **kwargs)
        metrics, module = group.metrics(), self.lightning_module
        module.log("ft/participants", metrics.pop("ft/participants"), on_step=True, on_epoch=False, prog_bar=True)
        module.log_dict(metrics, on_step=True, on_epoch=False)
        return result

    @override
    def extra_state(self) -> dict[str, Any]:
        """With replica groups, torchft's state (committed steps, batches) beside the strategy's own."""
        state = super().extra_state()
        if self.replica_group is not None:
            manager = self.replica_group.manager.state_dict()
            state.update({f"torchft.{key}": torch.tensor(value) for key, value in manager.items()})
        return state

    @override
    def load_extra_state(self, read: Any) -> None:
        super().load_extra_state(read)
        if self.replica_groups is not None:
            found = read({"torchft.step": torch.tensor(0), "torchft.batches_committed": torch.tensor(0)})
            self._restored_torchft = {key.split(".", 1)[1]: int(value) for key, value in found.items()}

    @override
    def teardown(self) -> None:
        if self.replica_group is not None:
            self.replica_group.shutdown()
            self.replica_group = None
        super().teardown()
