"""Pipeline parallelism (GPipe, 1F1B, interleaved 1F1B, zero bubble) inside the Lightning loop, composable with FSDP
and TP.

The schedules are torch's (`torch.distributed.pipelining`); the integration is ours. A pipeline schedule's
`step()` runs forward and backward for every microbatch itself, so this strategy owns the whole training
step: it zeroes gradients where the loop would (the first micro-step of each accumulation window), runs the
schedule, and tells the loop to skip its own zero_grad and backward (`fit_loop._skip_backward`, the switch
Lightning's StochasticWeightAveraging uses). Optimizer step, LR schedulers, gradient clipping (global norm
across stages and shards) and accumulation keep their meaning. Because no rank holds the whole model, the
strategy computes the loss with the model plan's `loss` on the last stage and logs `train_loss`,
`val_loss` and `test_loss` itself, broadcast to every stage.

Accumulation: torch's schedules end every `step()` with each stage's gradient reduction (`perform_reduce_grad`,
which turns FSDP's gradient sync back on and reduce-scatters). On accumulation micro-steps the strategy holds it
back (`block_backward_sync`, which Lightning enters on exactly those micro-steps), so each stage reduce-scatters
once per optimizer step, as `fsdp_tp` does.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from typing_extensions import override

from parallelkit.compat import quiet_root_view_warning, skip_loop_backward
from parallelkit.contract import is_preference_batch, token_share
from parallelkit.errors import ConfigError, PlanError
from parallelkit.mesh import reduction_size, token_group
from parallelkit.parallel import ResolvedPlan, parallelize, resolve
from parallelkit.parallel.schedule import Schedule
from parallelkit.strategies.base import MeshShape, ParallelkitStrategy
from parallelkit.strategies.pipeline_pairs import PipelinePairs
from parallelkit.strategies.reference import build_reference, wanted_reference
from parallelkit.strategies.stage_clock import StageClock


class PipelineStrategy(ParallelkitStrategy):
    """Pipeline parallel training (GPipe, 1F1B, interleaved 1F1B, zero bubble), alone or with FSDP and tensor
    parallelism.

    The model's `pipeline_layers` are cut into stages that keep their parameter names, so a checkpoint is the
    same whatever the layout. Each rank's stages are sharded over the inner axes exactly as `fsdp_tp` does.

    Args:
        mesh_shape: Sizes then axis names with a `pp` axis, e.g. `[[2, 2], ["pp", "fsdp"]]` or
            `[[2, 1, 2], ["pp", "fsdp", "tp"]]`. "auto": every process is a pipeline stage.
        schedule: "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", or a zero-bubble schedule, which splits each
            backward into an input-gradient and a weight-gradient step and fills the bubble with the latter:
            "interleaved_zero_bubble" (ZB1P, stages placed as interleaved 1F1B's), "zbv" (ZB-V) or "dualpipev"
            (DeepSeek's DualPipe, V variant); the last two place two stages per rank in a V (rank 0 holds the first
            and the last). Zero-bubble schedules take no activation checkpointing.
        microbatches: Microbatches each process's batch is split into; must divide `data.batch_size`.
            Default: 2 x the number of stages (fewer bubbles than the minimum, one stage's worth).
        stages_per_rank: Virtual stages per rank for interleaved schedules (default 2; 1 otherwise; "zbv" and
            "dualpipev" take exactly 2).
        split_points: Where each stage after the first begins, as indices into the expanded pipeline
            layers or as layer names (e.g. ["blocks.2"]). Default: balanced by parameter count.
        schedule_stats: Log each step's per-stage busy time and measured bubble fraction (`pp_bubble`), next
            to the theoretical one (`pp_bubble_theory`). Adds a device synchronisation per microbatch.
        reshard_after_forward: FSDP policy inside each stage. Default "never": resharding would repeat the
            all-gather for every microbatch.
        **kwargs: The options every parallelkit strategy takes (`ParallelkitStrategy`). Here `compile` compiles
            each pipeline layer's block, not with the zero-bubble schedules, whose split backward torch cannot run
            compiled; `save_distributed_checkpoint` must stay True (rank 0 holds only its own stages; a single-file
            checkpoint written by fsdp_tp loads here).
    """

    required_axes = ("pp", "fsdp", "tp")

    def __init__(
        self,
        mesh_shape: MeshShape = "auto",
        schedule: str = "1f1b",
        microbatches: int | None = None,
        stages_per_rank: int | None = None,
        split_points: list[int | str] | None = None,
        schedule_stats: bool = False,
        reshard_after_forward: Literal["default", "always", "never"] = "never",
        **kwargs: Any,
    ) -> None:
        super().__init__(mesh_shape=mesh_shape, reshard_after_forward=reshard_after_forward, **kwargs)
        self.schedule = schedule.lower()
        self._stages_per_rank = stages_per_rank
        self._microbatches = microbatches
        self.split_points = split_points
        self.schedule_stats = schedule_stats
        self._clock: StageClock | None = None
        self.pairs = PipelinePairs(self)
        """The preference steps (`parallelkit.strategies.pipeline_pairs`): idle until a preference batch comes."""
        self._schedule: Any = None
        self._stages: list[_Stage] = []
        self._loss_scale = 1.0
        self._predicting = False
        self._step_targets: torch.Tensor | None = None
        self._training = False  # whether the schedule step running now trains (its losses get the auxiliary loss)

    @property
    def pipeline(self) -> Schedule:
        """The schedule over this run's pp ranks (`parallelkit.parallel.schedule`: placement, defaults, checks)."""
        pp = self.mesh_spec.size("pp") if self.mesh_spec is not None else 1
        return Schedule(self.schedule, pp, self._stages_per_rank, self._microbatches)

    def check_options(self) -> None:
        super().check_options()
        self.pipeline.check_options(self.activation_checkpointing, self.compile)

    @property
    def stages_per_rank(self) -> int:
        return self.pipeline.stages_per_rank

    def auto_mesh(self, num_nodes: int, devices: int) -> MeshShape:
        """Every process a pipeline stage."""
        return [[-1], ["pp"]]

    @property
    def pp_size(self) -> int:
        return self.mesh_spec.size("pp")

    @property
    def num_stages(self) -> int:
        return self.pipeline.num_stages

    @property
    def microbatches(self) -> int:
        return self.pipeline.microbatches

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if not self.save_distributed_checkpoint:
            raise ConfigError(
                "save_distributed_checkpoint=False writes one file from rank 0, which holds only the first pipeline "
                "stage. Keep the sharded default and take one file with: parallelkit consolidate CKPT_DIR OUT.pt"
            )
        self.pipeline.check_layout(self.mesh_spec)

    def stage_indices(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` holds (`Schedule.stage_indices`)."""
        return self.pipeline.stage_indices(pp_rank)

    @override
    def setup(self, trainer: Any) -> None:
        reference = wanted_reference(self.lightning_module)  # preference tuning's frozen copy, whole until split
        super().setup(trainer)
        if reference is not None:  # its own stages, run forward only by the pairs' reference pass
            mine = self.stage_indices(self.device_mesh["pp"].get_local_rank())
            _, self.pairs.reference_schedule = self._run_stages(build_reference(self, reference, parallelize, mine))

    def _run_stages(self, modules: Sequence[torch.nn.Module]) -> tuple[list[_Stage], Any]:
        """This rank's stage `modules` (its stages, in order) as torch's pipeline stages, and the schedule over them."""
        from torch.distributed.pipelining.schedules import get_schedule_class

        schedule, pp_mesh = self.pipeline, self.device_mesh["pp"]
        mine = schedule.stage_indices(pp_mesh.get_local_rank())
        stages = [
            _Stage(stage, index, schedule.num_stages, self.root_device, group=pp_mesh.get_group())
            for index, stage in zip(mine, modules)
        ]
        return stages, get_schedule_class(schedule.torch_class)(
            stages if schedule.multi_stage else stages[0],
            n_microbatches=schedule.microbatches,
            loss_fn=self._loss,
            # Not scale_grads: it divides all of .grad after the step, gradients accumulated by earlier
            # accumulation micro-steps included. The loss is divided instead (see _run).
            scale_grads=False,
        )

    def parallelize_model(self, trainer: Any) -> None:
        module = self.lightning_module
        pp_mesh = self.device_mesh["pp"]
        schedule = self.pipeline
        if trainer.state.fn == TrainerFn.FITTING:
            self._check_every_rank_trains(module, self.resolved.stages)
        mine = schedule.stage_indices(pp_mesh.get_local_rank())
        modules = parallelize(module, self.device_mesh, stages=mine, **self.parallelize_options())
        if self.reshard_after_forward != "always":
            for stage in modules:
                quiet_root_view_warning(stage)
        self._stages, self._schedule = self._run_stages(modules)
        if self.schedule_stats:
            self._clock = StageClock(self._stages, self.root_device)
        self._has_first = any(stage.is_first for stage in self._stages)
        self._has_last = any(stage.is_last for stage in self._stages)
        self._pp_group = pp_mesh.get_group()
        # The ranks whose tokens differ (data-parallel x cp: a cp rank's stages run its slice of each sequence), over
        # which losses are logged, and how many the gradient reduction averages over (without cp: the dp size).
        self._token_group = token_group(self)
        self._reduction_size = reduction_size(self)
        self._last_stage_rank = dist.get_global_rank(self._pp_group, schedule.last_stage_rank())
        self.pairs.bind(self._schedule, self._first_stage_args, self._last_stage_rank if self._has_last else None)
        # Gradient clipping adds up the stages' norms.
        self.precision_plugin.stage_group = pp_mesh.get_group()
        if trainer.state.fn == TrainerFn.FITTING:
            skip_loop_backward(trainer)  # the schedule runs backward itself

    def _check_every_rank_trains(self, module: Any, stages: Sequence[Sequence[str]]) -> None:
        """Refuse, on every rank alike, a split where some rank's stages hold no trainable parameter (a LoRA model
        whose adapters all sit in other stages): that rank's optimizer would be empty, which torch refuses."""
        for rank in range(self.pp_size):
            held = [name for i in self.stage_indices(rank) for name in stages[i]]
            if not any(p.requires_grad for name in held for p in module.get_submodule(name).parameters()):
                raise PlanError(
                    f"pipeline rank {rank} holds stages {self.stage_indices(rank)} ({', '.join(held)}), and none of "
                    "their parameters trains (the model's trainable parameters, e.g. LoRA adapters, are all in other "
                    "stages): its optimizer would be empty. Fix: split_points that give it a layer with trainable "
                    "parameters, a schedule with loop placement (e.g. 1f1b) instead of a V-shaped one, or adapters on "
                    "more layers (lora.targets)."
                )

    @override
    def resolve_plan(self, model: Any) -> ResolvedPlan:
        """The model's plan with its pipeline stages; refuses a model that cannot be pipelined (and what `fsdp_tp`
        refuses)."""
        if is_overridden("configure_model", model):
            raise PlanError(
                f"{type(model).__name__} overrides configure_model(), but pipeline strategies build stages from "
                "pipeline_layers and cannot split a model that parallelised itself. Remove configure_model() "
                "or use strategy='fsdp_tp'."
            )
        resolved = resolve(
            model,
            tp=self.mesh_spec.size("tp"),
            ep=self.mesh_spec.size("ep"),
            cp=self.mesh_spec.cp_size,
            cp_method=self.cp_method,
            sequence_parallel=self.sequence_parallel,
            loss_parallel=self.loss_parallel,
            num_stages=self.num_stages,
            split_points=self.split_points,
        )
        if resolved.plan.loss is None:
            raise PlanError(
                f"{resolved.description} has no pipeline_loss(output, target): the last pipeline stage needs it to "
                "compute the loss."
            )
        return resolved

    @override
    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        return super().batch_to_device(self.pairs.padded(batch), device, dataloader_idx)  # pairs: one shape, then cp

    @override
    def check_run(self, model: Any, datamodule: Any = None, accumulate_grad_batches: int = 1) -> None:
        super().check_run(model, datamodule, accumulate_grad_batches)
        if getattr(model, "preference", None) is not None:
            self.pairs.check(datamodule)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.pairs.mode is not None:  # a preference batch's microbatch
            return self.pairs.loss(output, target)
        auxiliary = self.resolved.plan.auxiliary_loss
        extra = auxiliary() if auxiliary is not None else 0.0  # taken from every forward, added in training
        if self._predicting:  # torch's schedules compute a loss on the last stage whatever the step is for
            return output.new_zeros(())
        loss = self.resolved.plan.loss(output, target)
        if self._step_targets is not None:  # a token batch: the microbatch's share of the step's token mean
            loss = token_share(loss, target, self._step_targets)
        elif self._training:  # as `CausalLM.training_step` adds it, on each microbatch
            loss = loss + extra
        return loss * self._loss_scale

    @property
    def last_stage_rank(self) -> int:
        """The global rank holding this rank's pipeline's last stage."""
        return self._last_stage_rank

    @property
    def pp_group(self) -> Any:
        """This rank's pipeline: the process group of its stages."""
        return self._pp_group

    def _check_batch(self, inputs: torch.Tensor) -> None:
        self.pipeline.check_batch(inputs.shape[0])

    def _run(self, batch: Any, *, train: bool) -> torch.Tensor:
        """One schedule step over a process's batch; returns its mean loss, the same on every stage (for a token
        batch: its share of the step's token mean, summed over the data-parallel group by the caller)."""
        tokens = isinstance(batch, Mapping)
        if tokens and train and self.resolved.plan.auxiliary_loss is not None:
            raise ConfigError(
                f"{self.resolved.description}: its routers' load-balancing loss (output_router_logits) with token "
                "batches (SFT, packed) under a pipeline is not supported: a token batch's loss is its share of the "
                "step's token mean, to which the per-microbatch load-balancing loss is not yet added. Fix: "
                "output_router_logits: false in the model's config, or train it without pp."
            )
        inputs, target = self.resolved.plan.split_batch(batch)
        self._check_batch(inputs)
        accumulate = self.lightning_module.trainer.accumulate_grad_batches if train else 1
        self._step_targets = batch["num_targets"] if tokens else None
        self._training = train
        # Pairs: the whole batch's mean loss is the mean over microbatches, and Lightning would divide by
        # accumulate_grad_batches before its own backward: both divisions happen here, on each microbatch. Token
        # batches: each share is multiplied by the reduction's size, which the stages' gradient reduction divides by
        # (`CausalLM.token_training_step`).
        self._loss_scale = self._reduction_size if tokens else 1 / (self.microbatches * accumulate)
        losses: list[torch.Tensor] = []
        args = self._first_stage_args(batch, inputs)
        run = self._schedule.step if train else self._schedule.eval
        timed = train and self._clock is not None
        if timed:
            self._clock.start()
        with self.loss_context():
            run(*args, target=target if self._has_last else None, losses=losses, return_outputs=False)
        if timed:
            self._clock.log(self.lightning_module, self._pp_group, self.root_device, self.theoretical_bubble)
        if self._has_last:
            loss = torch.stack([loss.detach().float() for loss in losses]).sum()
            loss = loss / self._reduction_size if tokens else loss * accumulate
        else:
            loss = torch.zeros((), device=self.root_device)
        dist.broadcast(loss, src=self._last_stage_rank, group=self._pp_group)
        return loss

    def _first_stage_args(self, batch: Any, inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What this rank's first stage is handed: the inputs, and a token batch's positions (packed examples)."""
        if not self._has_first:
            return ()
        return (inputs, batch["position_ids"]) if isinstance(batch, Mapping) else (inputs,)

    @property
    def theoretical_bubble(self) -> float | None:
        """The ideal schedule's idle fraction (`Schedule.theoretical_bubble`)."""
        return self.pipeline.theoretical_bubble

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-steps (Lightning enters this around them) keep every stage's gradients local: the
        schedule's closing reduction is held back until the last micro-step of the optimizer step."""
        for stage in self._stages:
            stage.reduce_gradients = False
        try:
            yield
        finally:
            for stage in self._stages:
                stage.reduce_gradients = True

    @override
    def training_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self.training_across_groups():
            return self._training_step(batch, batch_idx)

    def _training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        module = self.lightning_module
        trainer = module.trainer
        if batch_idx % trainer.accumulate_grad_batches == 0:
            # The loop's zero_grad would run after this step and erase the schedule's gradients; it is done here.
            for optimizer in trainer.optimizers:
                module.optimizer_zero_grad(trainer.current_epoch, batch_idx, optimizer)
        if is_preference_batch(batch):
            sums, pairs = self.pairs.run(batch, train=True)
            module.log_preference_step(sums, pairs, batch_idx)
            return sums[0] / pairs
        loss = self._run(batch, train=True)
        if isinstance(batch, Mapping):
            module.log_step_share(loss, batch_idx, trainer.accumulate_grad_batches)
            return loss
        module.log("train_loss", loss, on_step=True, prog_bar=True, sync_dist=True, sync_dist_group=self._token_group)
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> None:
        if is_preference_batch(batch):
            self.lightning_module.add_preference_validation(*self.pairs.run(batch, train=False), batch_idx)
            return
        loss = self._run(batch, train=False)
        weight = {}
        if isinstance(batch, Mapping):
            # The global micro-batch's token mean, weighted by its targets: the epoch's value is the token mean.
            loss = loss * self._reduction_size
            weight = {"batch_size": int(batch["num_targets"])}
        self.lightning_module.log(
            "val_loss", loss, on_epoch=True, prog_bar=True, sync_dist=True, sync_dist_group=self._token_group, **weight
        )

    @override
    def predict_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> Any:
        """The last stage's output for the batch's inputs (as the plan's `split_batch` finds them), on every rank."""
        inputs = self.resolved.plan.split_batch(batch)[0]
        self._check_batch(inputs)
        args = self._first_stage_args(batch, inputs)
        target = inputs.new_zeros(inputs.shape[0]) if self._has_last else None  # the schedule wants one
        self._predicting = True
        try:
            output = self._schedule.eval(*args, target=target, return_outputs=True)
        finally:
            self._predicting = False
        shared = [output if self._has_last else None]
        dist.broadcast_object_list(shared, src=self._last_stage_rank, group=self._pp_group)
        return shared[0]

    @override
    def test_step(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> None:
        loss = self._run(batch, train=False)
        self.lightning_module.log("test_loss", loss, on_epoch=True, sync_dist=True, sync_dist_group=self._token_group)


class _Stage(PipelineStage):
    """A pipeline stage whose end-of-step gradient reduction can be held back (gradient accumulation), and that runs
    forward-only steps of V-shaped schedules.

    torch's schedules end every step with each stage's `perform_reduce_grad`: it turns FSDP's gradient sync back on
    and runs every FSDP group's post-backward, which reduce-scatters the gradients the microbatches accumulated
    unsharded (the schedule keeps sync off between them). Held back (`reduce_gradients` False), the stage only
    reshards its parameters, as FSDP does after a backward without sync: the unsharded gradients stay and keep
    accumulating, and the last micro-step's reduction sends them all at once.
    """

    reduce_gradients = True

    @override
    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        if self.reduce_gradients:
            super().perform_reduce_grad(grad_scale_factor)
            return
        for module in self.submod.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    # torch 2.13's eval() runs a schedule's backward actions as no-ops, but still hands each backward's input
    # gradients to the previous stage when that stage is on the same rank, and both ends assert that there is a
    # backward: every V-shaped schedule's validation failed at the turn of the V. There is nothing to hand over.
    @override
    def get_local_bwd_output(self, mb_index: int) -> tuple[torch.Tensor | None, ...]:
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    @override
    def set_local_bwd_input(self, next_stage_bwd_outputs: tuple[torch.Tensor | None, ...], mb_index: int) -> None:
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)
