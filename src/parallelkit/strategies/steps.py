"""How each step runs on the parallel model: the Lightning step hooks of a parallelkit strategy.

`ParallelSteps` is mixed into `ParallelkitStrategy` ahead of `ShardedCheckpoints` and Lightning's
`ModelParallelStrategy`, whose step hooks it overrides: every step runs as the forward of the FSDP root, inside loss
parallelism when asked for; gradients are held back on accumulation micro-steps; and what leaving FSDP out asks of
the strategy (the model's `DataParallelWrap`, read in `setup`: gradients settled after each backward, plain tensors
replicated in the optimizer's update) is done here; under context parallelism each batch reaches the step as this
rank's slice of its sequences. The strategy keeps the Lightning lifecycle, this the steps.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from typing_extensions import override

from parallelkit.compat import run_as_forward
from parallelkit.grad_norm import settle_gradients
from parallelkit.optim import compile_step, mixes_plain_and_dtensors, replicate_plain_tensors
from parallelkit.parallel.context_parallel import SequenceSplit, split_batch
from parallelkit.parallel.replica_groups import CommitGate, ReplicaGroup


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

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        if self.data_parallel.settle_gradients and not self._accumulating:
            settle_gradients(self.model)

    # -- replica groups (`parallelkit.parallel.replica_groups`): data parallelism across separately launched groups --
    replica_group: ReplicaGroup | None = None

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
        """Under `replica_groups`, this rank's torchft manager, once the process group inside the group exists: the
        state a returning group copies is the model's and the optimizers' (each rank's own shards)."""
        if self.replica_groups is None:
            return
        trained = [p for p in self.model.parameters() if p.requires_grad]  # set once sharded: what crosses groups
        state = _GroupState(self)
        self.replica_group = ReplicaGroup(self.replica_groups, self.global_rank, self.world_size, state, trained)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        if self.replica_group is not None and batch_idx % self.lightning_module.trainer.accumulate_grad_batches == 0:
            self.replica_group.start_step()  # the quorum forms while the step's forward runs

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Under replica groups: the closure's gradients averaged across the step's groups before the loop clips
        them, and the optimizer stepped only if the step commits (`CommitGate`); what the quorum was, logged."""
        group = self.replica_group
        if group is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def averaged() -> Any:
            result = closure()
            group.average_gradients()
            return result

        result = super().optimizer_step(CommitGate(optimizer, group), averaged, model, **kwargs)
        metrics, module = group.metrics(), self.lightning_module
        module.log("ft/participants", metrics.pop("ft/participants"), on_step=True, on_epoch=False, prog_bar=True)
        module.log_dict(metrics, on_step=True, on_epoch=False)
        return result

    @override
    def teardown(self) -> None:
        if self.replica_group is not None:
            self.replica_group.shutdown()
            self.replica_group = None
        super().teardown()


class _GroupState:
    """What a returning replica group copies from a healthy one (torchft's `state_dict`/`load_state_dict`): this
    rank's shards of the model and the optimizers' states."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.strategy.model.state_dict(),
            "optimizers": [optimizer.state_dict() for optimizer in self.strategy.optimizers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.model.load_state_dict(state["model"])
        for optimizer, saved in zip(self.strategy.optimizers, state["optimizers"]):
            optimizer.load_state_dict(saved)
