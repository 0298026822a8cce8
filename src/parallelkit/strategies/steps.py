"""How each step runs on the parallel model: the Lightning step hooks of a parallelkit strategy.

`ParallelSteps` is mixed into `ParallelkitStrategy` ahead of `ShardedCheckpoints` and Lightning's
`ModelParallelStrategy`, whose step hooks it overrides: every step runs as the forward of the FSDP root, inside loss
parallelism when asked for; gradients are held back on accumulation micro-steps; and what leaving FSDP out asks of
the strategy (the model's `DataParallelWrap`, read in `setup`: gradients settled after each backward, plain tensors
replicated in the optimizer's update) is done here; under context parallelism each batch reaches the step as this
rank's slice of its sequences; replica groups' hooks come from `ReplicaGroupSteps`, this saying who shares a group's
rows. The strategy keeps the Lightning lifecycle, this the steps.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from typing_extensions import override

from parallelkit.compat import (
    run_as_forward,
)
from parallelkit.contract import REPLICA_TARGETS
from parallelkit.errors import ConfigError
from parallelkit.mesh import stage_group
from parallelkit.optimizers.compiled import compile_step, mixes_plain_and_dtensors, replicate_plain_tensors
from parallelkit.optimizers.grad_norm import settle_gradients
from parallelkit.optimizers.muon import Muon
from parallelkit.parallel.context_parallel import SequenceSplit, split_batch
from parallelkit.strategies.replica_steps import ReplicaGroupSteps


class ParallelSteps(ReplicaGroupSteps):
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
        sliced = split_batch(batch, split, spec.dp_size * accumulated)
        if self.replica_groups is not None and not isinstance(batch, Mapping) and "num_targets" in sliced:
            # Windows made a token batch: every rank of every group holds as many targets.
            replicas = spec.dp_size * self.replica_groups.num_groups
            sliced[REPLICA_TARGETS] = (sliced["num_targets"] // spec.dp_size).expand(replicas).clone()
        return sliced

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

    # -- replica groups (`ReplicaGroupSteps`): the group's data-parallel ranks are the mesh's --
    @override
    def group_data_parallel(self) -> tuple[int, int]:
        return self.mesh_spec.dp_size, self.mesh_spec.dp_rank(self.global_rank)

    @override
    def group_mesh(self) -> Any:
        return self.mesh_spec

    @override
    def sharded_gradients(self) -> bool:
        return self.data_parallel.fsdp

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.training_across_groups(), self.loss_context(), self.precision_plugin.train_step_context():
            return self._in_root_forward("training_step", *args, **kwargs)

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
