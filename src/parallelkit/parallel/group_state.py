"""What replica groups share and copy: this rank's trained shards, buffers, optimizer state and training position
(`GroupState`, torchft's state_dict / load_state_dict), and the layout two groups must have in common to do it."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from parallelkit.compat import local_shard
from parallelkit.errors import ReplicaGroupError


class GroupState:
    """What a group that comes back copies from a healthy one (torchft's `state_dict` and `load_state_dict`, sent
    over its HTTP checkpoint transport): this rank's shards of the trained parameters, the model's buffers (BatchNorm
    statistics and any other a step changes), the optimizers' states, and the training position as the step began
    (`position`: loops, schedulers, data position, RNG). torchft reads it on its quorum thread while the main thread
    waits for the quorum (between steps, or before a step is tried again), so nothing moves under it; the tensors are
    taken sharded, as named at the group's join, not through the model's `state_dict` hooks. `layout` (processes,
    mesh, trained shards, buffers) must be the same on both sides."""

    def __init__(
        self,
        layout: str,
        parameters: dict[str, torch.nn.Parameter],
        optimizers: list[Any],
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.layout, self.parameters, self.optimizers = layout, parameters, optimizers
        self.buffers = buffers or {}
        self.position: dict[str, Any] = {}
        self.healed: dict[str, Any] | None = None  # the position copied, at the join or in the middle of a step

    def state_dict(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "parameters": {name: local_shard(p).detach() for name, p in self.parameters.items()},
            "buffers": {name: local_shard(b).detach() for name, b in self.buffers.items()},
            "optimizers": [_optimizer_state(optimizer) for optimizer in self.optimizers],
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["layout"] != self.layout:
            raise ReplicaGroupError(
                f"this replica group cannot take the state of the group it heals from: that one runs "
                f"{state['layout']}, this one {self.layout}. Fix: launch every group with the same mesh_shape, "
                "devices and model."
            )
        with torch.no_grad():
            for name, param in self.parameters.items():
                local_shard(param).copy_(state["parameters"][name])
            for name, buffer in self.buffers.items():
                local_shard(buffer).copy_(state["buffers"][name])
        for optimizer, saved in zip(self.optimizers, state["optimizers"]):
            optimizer.load_state_dict(_optimizer_state_back(saved, optimizer))
        self.healed = state["position"]


def describe_layout(
    world_size: int, mesh: Any, parameters: dict[str, torch.nn.Parameter], buffers: dict[str, torch.Tensor]
) -> str:
    """What two groups' ranks must share to average their gradients and copy each other's state: the processes, the
    mesh (or "ddp"), and this rank's shards of the trained parameters and of the buffers (names, shapes, dtypes; a
    digest)."""
    shards = [(name, tuple(local_shard(t).shape), str(t.dtype)) for name, t in {**parameters, **buffers}.items()]
    digest = hashlib.sha256(repr(shards).encode()).hexdigest()[:12]
    where = f"mesh_shape {mesh}" if mesh is not None else "ddp"
    return f"{world_size} processes on {where}, {len(parameters)} trained tensors (shards {digest})"


def _optimizer_state(optimizer: Any) -> dict[str, Any]:
    """An optimizer's `state_dict` with its DTensors as their local shards and their layout (a DTensor's mesh does
    not travel): see `_optimizer_state_back`."""
    saved = optimizer.state_dict()
    state, layouts = {}, {}
    for index, entries in saved["state"].items():
        state[index] = {key: local_shard(value) for key, value in entries.items()}
        for key, value in entries.items():
            if isinstance(value, DTensor):
                layouts[(index, key)] = (value.shape, value.stride(), value.placements)
    return {"state": state, "param_groups": saved["param_groups"], "dtensors": layouts}


def _optimizer_state_back(saved: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """`_optimizer_state`'s state for `optimizer` (this group's, of the same layout), its shards made DTensors again
    on their parameters' meshes."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {index: dict(entries) for index, entries in saved["state"].items()}
    for (index, key), (shape, stride, placements) in saved["dtensors"].items():
        mesh = params[index].device_mesh
        local = state[index][key].to(params[index].device)
        state[index][key] = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    return {"state": state, "param_groups": saved["param_groups"]}
