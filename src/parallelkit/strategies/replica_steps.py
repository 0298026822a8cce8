"""The step hooks of replica groups (`parallelkit.parallel.replica_groups`), for every strategy that takes them.

`ReplicaGroupSteps` is mixed into a strategy ahead of its Lightning base (`ParallelkitStrategy`, with its pipelines,
and `DDPStrategy`): each optimizer step, as its first micro-batch starts, asks for the step's quorum; a token batch's
loss is divided by the target count of the step's participating groups, exchanged through that quorum; the
gradients are averaged (summed, for token batches) across the groups before the loop clips them; the optimizer
steps only when the step commits, and a step that does not is tried again on the same micro-batches, the earlier
ones run again. The strategy says who shares a group's data (`group_data_parallel`) and runs its training step inside
`training_across_groups`, where a value logged with `sync_dist` is the job's (reduced over the step's groups too).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
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
    set_rng_states,
    strategy_hook,
    training_position,
)
from parallelkit.contract import REPLICA_TARGETS, is_preference_batch
from parallelkit.errors import ConfigError
from parallelkit.parallel.group_state import GroupState, describe_layout
from parallelkit.parallel.replica_groups import CommitGate, ReplicaGroup, ReplicaGroups


class ReplicaGroupSteps:
    """The replica-group hooks of a strategy (module docstring). It reads the strategy's `replica_groups`,
    `lightning_module`, `model`, `optimizers`, `global_rank` and `world_size`."""

    replica_groups: ReplicaGroups | None = None
    replica_group: ReplicaGroup | None = None
    _in_training_step = False
    _restored_torchft: dict[str, int] | None = None  # torchft's state in the checkpoint this run resumes from
    _step_batches: list[tuple[Any, int]]  # the optimizer step's micro-batches so far, as the step hook got them
    _step_targets: torch.Tensor | None = None  # a token step's target count over the quorum's groups

    def group_data_parallel(self) -> tuple[int, int]:
        """(size, rank) of this rank among the ranks of its group that take different rows: every rank (DDP); a
        strategy with a mesh counts its data-parallel axes."""
        return self.world_size, self.global_rank

    def group_mesh(self) -> Any:
        """The group's mesh (a `MeshSpec`), None for DDP: part of the layout every group must share."""
        return None

    def steps_across_groups(self) -> bool:
        """Whether every optimizer step crosses the groups (a quorum, its gradients reduced, a commit). A strategy
        whose groups meet less often (DiLoCo's outer steps) says no and asks for its own quorums."""
        return True

    def check_join(self, healed: dict[str, Any] | None) -> None:
        """Called as the group has joined, with the training position it copied from another (None if it was not
        behind): a strategy refuses here what it cannot continue from."""

    def sharded_gradients(self) -> bool:
        """Whether FSDP2 reduce-scatters the trained parameters' gradients, unit by unit (then the cross-group
        reduction can start with each unit's: `ReplicaGroups.overlap`)."""
        return False

    @contextmanager
    def training_across_groups(self) -> Generator[None, None, None]:
        """Around a training step's body: values it logs with `sync_dist` are reduced across the step's groups."""
        self._in_training_step = True
        try:
            yield
        finally:
            self._in_training_step = False

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """A logged value's `sync_dist` reduction, over `group` (default: every rank); under replica groups, a value
        logged in the training step across the step's groups too: `train_loss` is the job's, as one process's."""
        reduced = reduce_logged(tensor, group, reduce_op)
        if self.replica_group is None or not self._in_training_step or not self.steps_across_groups():
            return reduced
        return self.replica_group.reduce(reduced, reduce_op)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """This rank's share of each global batch: among its group's data-parallel ranks, and under replica groups
        among every group's (group g's ranks take the shares after those of groups 0..g-1)."""
        size, rank = self.group_data_parallel()
        groups = self.replica_groups
        if groups is not None:
            size, rank = size * groups.num_groups, groups.group * size + rank
        return {"num_replicas": size, "rank": rank}

    def join_replica_groups(self) -> None:
        """Under `replica_groups`, this rank's torchft manager (heartbeating to the lighthouse from here on), and the
        first quorum once the checkpoint this run resumes from (if any) has given the model, optimizers and training
        position (`_join`). Call it at the end of the strategy's `setup`."""
        if self.replica_groups is None:
            return
        trained = {name: p for name, p in self.model.named_parameters() if p.requires_grad}  # sharded by now
        buffers = dict(self.model.named_buffers())
        layout = describe_layout(self.world_size, self.group_mesh(), trained, buffers)
        state = GroupState(layout, trained, self.optimizers, buffers)
        self.replica_group = ReplicaGroup(self.replica_groups, self.global_rank, self.world_size, state)
        if self.replica_groups.overlap and self.sharded_gradients() and self.steps_across_groups():
            self.replica_group.overlap()
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
        self.check_join(healed)
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
        """The first micro-batch of an optimizer step asks for the step's quorum (and, for a token batch, the
        quorum's target count); every micro-batch is kept until the step ends, for a retry to run again."""
        super().on_train_batch_start(batch, batch_idx)
        if self.replica_group is None or not self.steps_across_groups():
            return
        if is_preference_batch(batch):
            raise ConfigError(
                "replica_groups with preference pairs (model.preference): the metrics and the NLL term's count are "
                "one group's, and a healing group's frozen reference is not checked; not done yet. Fix: train "
                "preference tuning without replica_groups."
            )
        if isinstance(batch, Mapping) and "num_targets" in batch and REPLICA_TARGETS not in batch:
            raise ConfigError(
                "replica_groups with token batches that do not say each replica's target count: the loss is divided "
                "by the targets of the groups taking part, which vary from step to step. Fix: parallelkit.data."
                f"SFTDataModule (its batches carry '{REPLICA_TARGETS}'), or add it to your batches: the optimizer "
                "step's target count of every data-parallel rank of every group, group by group."
            )
        trainer = self.lightning_module.trainer
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._step_batches = []
            position = {**training_position(trainer), "rng": rng_states()}
            self.replica_group.start_step(position)  # what a group joining in this step's quorum copies
        self._step_batches.append((batch, batch_idx))
        if len(self._step_batches) == 1:
            self._exchange_targets()
        elif self._step_targets is not None:
            batch["num_targets"] = self._step_targets

    def _exchange_targets(self) -> None:
        """A token step's count, for the quorum the step now has: this group's (its ranks' entries of
        `REPLICA_TARGETS`) summed over the quorum's groups, set as `num_targets` of every micro-batch so far."""
        first = self._step_batches[0][0]
        if not (isinstance(first, Mapping) and REPLICA_TARGETS in first):
            self._step_targets = None
            self.replica_group.gradient_op = "mean"
            return
        size, _ = self.group_data_parallel()
        start = self.replica_groups.group * size
        own = first[REPLICA_TARGETS][start : start + size].sum().float()
        total = self.replica_group.reduce(own, "sum").round().long()
        self._step_targets = total.to(first["num_targets"].device)
        for batch, _ in self._step_batches:
            batch["num_targets"] = self._step_targets
        self.replica_group.gradient_op = "sum"

    def _replay(self, optimizer: Any) -> None:
        """Before a retry: the step's gradients zeroed, a token step's count taken for the new quorum, and the
        micro-batches before the last run again as the loop ran them (their gradients kept local until the last)."""
        trainer, module = self.lightning_module.trainer, self.lightning_module
        *earlier, (_, last_idx) = self._step_batches
        module.optimizer_zero_grad(trainer.current_epoch, last_idx, optimizer)
        self._exchange_targets()
        for batch, batch_idx in earlier:
            with self.block_backward_sync():
                output = strategy_hook(trainer, "training_step", batch, batch_idx)
                loss = output["loss"] if isinstance(output, Mapping) else output
                if isinstance(loss, torch.Tensor) and loss.requires_grad:  # a pipeline's schedule did its backward
                    strategy_hook(trainer, "backward", loss / trainer.accumulate_grad_batches, optimizer)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Under replica groups: the closure's gradients averaged across the step's groups before the loop clips
        them, and the optimizer stepped only if the step commits (`CommitGate`); what the quorum was, logged."""
        group = self.replica_group
        if group is None or not self.steps_across_groups():
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def averaged() -> Any:
            result = closure()
            group.average_gradients()
            return result

        module = self.lightning_module
        gate = CommitGate(optimizer, group, lambda: self._replay(optimizer), module.trainer.global_step)
        result = super().optimizer_step(gate, averaged, model, **kwargs)
        metrics = group.metrics()
        module.log("ft/participants", metrics.pop("ft/participants"), on_step=True, on_epoch=False, prog_bar=True)
        module.log_dict(metrics, on_step=True, on_epoch=False)
        return result

    @override
    def teardown(self) -> None:
        if self.replica_group is not None:
            self.replica_group.shutdown()
            self.replica_group = None
        super().teardown()
