"""DiLoCo: data-parallel replicas that train on their own for `sync_every` steps, then synchronise once.

Each replica (one process, or an fsdp/tp group of them) runs the model's own optimizer (the inner optimizer)
with no gradient communication across replicas. Every `sync_every` optimizer steps the replicas average their
pseudo-gradient, the distance they moved since the last synchronisation, and an outer SGD step (Nesterov
momentum in DiLoCo) moves the shared weights along it; every replica continues from the result. With
`outer_lr=1` and no momentum that is parameter averaging (local SGD); with `sync_every=1` as well and a plain
SGD inner optimizer, it is exactly data-parallel SGD.

Communication across replicas is one all-reduce of the parameters every `sync_every` steps instead of one of
the gradients every step: 1/`sync_every` of DDP's bytes.

Over replica groups (`replica_groups`, torchft), each group is a replica: its own launch and mesh (no `replicate`
axis), no communication between groups during the inner steps, and each synchronisation an outer step through
torchft's quorum: the groups still there average their pseudo-gradients and take the outer step only when it
commits; one that failed is left out of a retry. A group lost between synchronisations costs the job only that
group's inner steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from typing_extensions import override

from parallelkit import CheckpointError, CommHook, ConfigError, FSDPTPStrategy, MeshSpec, parallelize, resolve_comm_hook
from parallelkit.checkpoint.strategy import FLAT
from parallelkit.parallel.replica_groups import MAX_RETRIES
from parallelkit.strategies.base import MeshShape


class DiLoCoStrategy(FSDPTPStrategy):
    """DiLoCo / local SGD over a `replicate` axis, each replica optionally sharded (fsdp) and tensor-parallel (tp).

    Args:
        mesh_shape: Sizes then axis names, outer to inner; must contain `replicate`, e.g. `[[2], ["replicate"]]`
            (every process its own replica) or `[[2, 2], ["replicate", "fsdp"]]` (2 replicas, each sharded over
            2 processes). "auto": every process is a replica.
        sync_every: Inner optimizer steps between synchronisations (DiLoCo's H).
        outer_lr: Learning rate of the outer SGD step on the averaged pseudo-gradient (1.0 = take the average).
        outer_momentum: Momentum of the outer SGD (0.0 with outer_lr=1.0 is local SGD's plain averaging).
        nesterov: Nesterov momentum for the outer step (DiLoCo's choice).
        outer_comm_precision: Precision of the synchronisation all-reduce: "fp32" (default), "bf16", "fp16", or
            any installed comm hook that reduces in a dtype (not one that replaces the collective, such as int8).
        **kwargs: Arguments of `parallelkit.FSDPTPStrategy` for the replicas' inner layout (activation_checkpointing,
            comm_precision of the inner fsdp reduce-scatter, profile_communication, timeout, ...).
    """

    plugin_api = 1
    required_axes = ("replicate", "fsdp", "tp")

    def __init__(
        self,
        mesh_shape: MeshShape = "auto",
        sync_every: int = 8,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        outer_comm_precision: str | CommHook | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(mesh_shape=mesh_shape, **kwargs)
        self.sync_every = sync_every
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.nesterov = nesterov
        self.outer_comm_precision = outer_comm_precision
        self.outer_hook: CommHook | None = None
        self._anchor: list[torch.Tensor] | None = None  # the weights of the last synchronisation, local shards
        self._outer_optimizer: torch.optim.Optimizer | None = None

    def check_options(self) -> None:
        super().check_options()
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ConfigError(f"sync_every={self.sync_every!r}: give the number of inner steps between syncs (>= 1).")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ConfigError(
                f"outer_lr={self.outer_lr}, outer_momentum={self.outer_momentum}: need outer_lr > 0 and "
                "0 <= outer_momentum < 1 (DiLoCo: 0.7 and 0.9; local SGD: 1.0 and 0.0)."
            )
        self.outer_hook = resolve_comm_hook(self.outer_comm_precision)
        if type(self.outer_hook).configure is not CommHook.configure:
            raise ConfigError(
                f"outer_comm_precision={self.outer_comm_precision!r} replaces FSDP's reduce-scatter and has no "
                "all-reduce form for the outer synchronisation; use fp32, bf16 or fp16."
            )

    def auto_mesh(self, num_nodes: int, devices: int) -> MeshShape:
        return [[-1], ["replicate"]]

    def full_mesh_spec(self, spec: MeshSpec) -> MeshSpec:
        if "replicate" not in spec.names and self.replica_groups is None:
            raise ConfigError(
                f"strategy diloco needs a 'replicate' axis (the replicas that synchronise every sync_every steps), "
                f'but mesh_shape is {spec}. Fix: [[{spec.world_size}], ["replicate"]], or put replicate outermost '
                f"before the inner axes: {MeshSpec((1, *spec.sizes), ('replicate', *spec.names))} with its size; "
                "or make each replica a replica group of its own (replica_groups)."
            )
        return super().full_mesh_spec(spec)

    # -- the replicas --------------------------------------------------------------------------------------------
    def parallelize_model(self, trainer: Any) -> None:
        """Shard and tensor-parallelise inside each replica only: no gradient ever crosses the replicate axis."""
        inner = self.device_mesh["fsdp", "tp"]
        if self.mesh_spec.size("fsdp") == 1 and self.precision_plugin.param_dtype is None:
            inner = self.device_mesh["tp"]  # nothing to shard: no FSDP, so no size-1 collectives either
        parallelize(self.model, inner, **self.parallelize_options())

    def _trainable(self) -> list[tuple[str, torch.Tensor]]:
        """Every trainable parameter with its name (the model's FQN, whatever the layout)."""
        return [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]

    def _local_parameters(self) -> list[torch.Tensor]:
        """This rank's part of every trainable parameter (DTensors' local shards, in place)."""
        return [p.to_local() if isinstance(p, DTensor) else p for _, p in self._trainable()]

    @property
    def replica(self) -> int:
        """This process's replica: its coordinate on the `replicate` axis."""
        return self.device_mesh["replicate"].get_local_rank()

    @override
    def steps_across_groups(self) -> bool:
        return False  # the groups meet at the synchronisations only

    @override
    def check_join(self, healed: dict[str, Any] | None) -> None:
        if healed is not None:
            raise ConfigError(
                f"replica group {self.replica_groups.group} joined a DiLoCo job the other groups had already trained: "
                "a group coming back between synchronisations is not done yet. Fix: relaunch every group from its "
                "last checkpoint (--ckpt_path=last), or let the others go on without it."
            )

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if self._anchor is None:  # first step of this fit (fresh or resumed): the weights all replicas share
            self._set_anchor()
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if (self.lightning_module.trainer.global_step + 1) % self.sync_every == 0:
            self.synchronize()
            if self.replica_group is not None:
                metrics, module = self.replica_group.metrics(), self.lightning_module
                module.log("ft/participants", metrics.pop("ft/participants"), on_step=True, on_epoch=False)
                module.log_dict(metrics, on_step=True, on_epoch=False)
        return output

    @override
    def on_train_end(self) -> None:
        # The replicas end where they are; the model a user keeps is their synchronised one.
        if self._anchor is not None and self.lightning_module.trainer.global_step % self.sync_every:
            self.synchronize()
        super().on_train_end()

    @torch.no_grad()
    def _set_anchor(self, anchor: list[torch.Tensor] | None = None) -> None:
        """Start the outer loop from `anchor` (local shards, one per trainable parameter; default: the weights now)."""
        self._anchor = anchor if anchor is not None else [p.detach().clone() for p in self._local_parameters()]
        self._outer_optimizer = torch.optim.SGD(
            self._anchor,
            lr=self.outer_lr,
            momentum=self.outer_momentum,
            nesterov=self.nesterov and self.outer_momentum > 0,  # torch refuses Nesterov without momentum
        )

    @torch.no_grad()
    def synchronize(self) -> None:
        """Average the pseudo-gradients (anchor - local) over the replicas, take the outer step, continue from it."""
        local = self._local_parameters()
        pseudo = torch.cat([(a - p).flatten() for a, p in zip(self._anchor, local)])
        if self.replica_group is not None:
            wire = self._averaged_over_groups(pseudo)
        else:
            replicate = self.device_mesh["replicate"]
            wire = pseudo.to(self.outer_hook.reduce_dtype or pseudo.dtype)
            # Divide before the sum so fp16 cannot overflow; bf16/fp32 lose nothing by it.
            wire.div_(replicate.size())
            dist.all_reduce(wire, group=replicate.get_group())
        offset = 0
        for anchor in self._anchor:
            anchor.grad = wire[offset : offset + anchor.numel()].view_as(anchor).to(anchor.dtype)
            offset += anchor.numel()
        self._outer_optimizer.step()
        self._outer_optimizer.zero_grad(set_to_none=True)
        for param, anchor in zip(local, self._anchor):
            param.copy_(anchor)

    def _averaged_over_groups(self, pseudo: torch.Tensor) -> torch.Tensor:
        """The pseudo-gradients' mean over the groups of this synchronisation's quorum, once it commits: a try that a
        group's failure breaks is made again with the groups left, each bringing its own pseudo-gradient again."""
        group, step = self.replica_group, self.lightning_module.trainer.global_step
        group.start_step({})
        for _ in range(MAX_RETRIES + 1):
            wire = pseudo.to(self.outer_hook.reduce_dtype or pseudo.dtype)
            group.manager.allreduce(wire).wait()  # the mean over the quorum's groups
            if group.should_commit():
                return wire
            if group.retry(step):
                raise ConfigError(
                    f"replica group {self.replica_groups.group} alone failed DiLoCo's synchronisation at step {step}: "
                    "healing in place is not done for DiLoCo yet. Fix: relaunch every group from its last checkpoint."
                )
        raise group.failure(f"could not commit the synchronisation at step {step}")

    # -- checkpoints ---------------------------------------------------------------------------------------------
    # The model and inner optimizer keys every strategy reads (`state_dict`, `optimizer_<i>`) hold replica 0's own
    # state; the outer state and the other replicas' state go through `extra_state`, keyed by parameter name:
    #   diloco.anchor.<fqn>                        weights of the last synchronisation (all replicas share them)
    #   diloco.outer_momentum.<fqn>                the outer SGD's momentum buffer, once the first sync made one
    #   diloco.replica<r>.optimizer_<i>.state.*    replica r's inner optimizer state (r >= 1; they never sync)
    #   diloco.replica<r>.model.<fqn>              replica r's weights (r >= 1), only between two synchronisations
    # Each is sharded as the parameter is inside a replica, so it loads under another inner layout.

    def _between_syncs(self) -> bool:
        """Whether the replicas' weights may differ now: a step was taken since the last synchronisation."""
        return self._anchor is not None and self.lightning_module.trainer.global_step % self.sync_every != 0

    @override
    def axes_out_of_sync(self) -> set[str]:
        return {"replicate"} if self._between_syncs() else set()

    def _replica_zero_only(self) -> bool:
        # DCP writes a key that several ranks give once, from whichever rank it picks, tensor by tensor: from
        # replicas whose weights and inner optimizer states differ, that would be a mixture no replica ever had.
        return self.save_distributed_checkpoint and self.replica != 0

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {} if self._replica_zero_only() else super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {} if self._replica_zero_only() else super().optimizer_state(optimizer)

    @staticmethod
    def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """`local` (this rank's part of a tensor shaped and sharded as `param`) as a tensor DCP can place."""
        if not isinstance(param, DTensor):
            return local
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )

    @override
    def extra_state(self) -> dict[str, Any]:
        if self._anchor is None:  # no step taken yet: the model is all there is
            return {}
        state: dict[str, Any] = {}
        for (name, param), anchor in zip(self._trainable(), self._anchor):
            state[f"diloco.anchor.{name}"] = self._like(param, anchor)
            momentum = self._outer_optimizer.state.get(anchor, {}).get("momentum_buffer")
            if momentum is not None:
                state[f"diloco.outer_momentum.{name}"] = self._like(param, momentum)
        if self.replica != 0:
            mine = f"diloco.replica{self.replica}"
            for index, optimizer in enumerate(self.optimizers):
                flat = get_optimizer_state_dict(self.model, optimizer, options=FLAT)
                state.update({f"{mine}.optimizer_{index}.{k}": v for k, v in flat.items() if k.startswith("state.")})
            if self._between_syncs():
                state.update({f"{mine}.model.{k}": v for k, v in get_model_state_dict(self.model).items()})
        return state

    @override
    @torch.no_grad()
    def load_extra_state(self, read: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        trainable = self._trainable()
        template: dict[str, Any] = {}
        for (name, param), local in zip(trainable, self._local_parameters()):
            template[f"diloco.anchor.{name}"] = self._like(param, torch.empty_like(local))
            template[f"diloco.outer_momentum.{name}"] = self._like(param, torch.empty_like(local))
        # Replica 0's own state is the model's and optimizers' keys, which the base class has loaded already.
        mine, others = f"diloco.replica{self.replica}", self.replica != 0
        model = get_model_state_dict(self.model) if others else {}
        template.update({f"{mine}.model.{k}": v for k, v in model.items()})
        inner = [get_optimizer_state_dict(self.model, o, options=FLAT) if others else {} for o in self.optimizers]
        for index, flat in enumerate(inner):
            template.update({f"{mine}.optimizer_{index}.{k}": v for k, v in flat.items() if k.startswith("state.")})
        found = read(template)

        # This replica's own weights and inner optimizer state, where saved; a replica the checkpoint's run did not
        # have continues from replica 0's.
        weights = {k: v for k, v in model.items() if f"{mine}.model.{k}" in found}
        if weights:
            set_model_state_dict(self.model, weights, options=StateDictOptions(strict=False))
        for index, (optimizer, flat) in enumerate(zip(self.optimizers, inner)):
            own = {k for k in flat if f"{mine}.optimizer_{index}.{k}" in found}
            if own:
                set_optimizer_state_dict(self.model, optimizer, flat, options=FLAT)

        names = [name for name, _ in trainable]
        anchors = [found.get(f"diloco.anchor.{name}") for name in names]
        if all(a is None for a in anchors):
            # A checkpoint without outer state (another strategy's): the first step anchors at the loaded weights.
            self._anchor, self._outer_optimizer = None, None
            return
        if any(a is None for a in anchors):
            missing = [name for name, a in zip(names, anchors) if a is None]
            raise CheckpointError(
                f"the checkpoint holds DiLoCo's anchor for {len(names) - len(missing)} of {len(names)} parameters "
                f"(missing: {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}): it was written for "
                "another model. Resume it with the model configuration it was saved from."
            )
        self._set_anchor([a.to_local() if isinstance(a, DTensor) else a for a in anchors])
        for name, anchor in zip(names, self._anchor):
            momentum = found.get(f"diloco.outer_momentum.{name}")
            if momentum is not None:
                local = momentum.to_local() if isinstance(momentum, DTensor) else momentum
                self._outer_optimizer.state[anchor]["momentum_buffer"] = local
