"""MeshSpec: the user's `mesh_shape` parsed, validated against the world, and built into a DeviceMesh.

The shape is written as in the seed docs, sizes then axis names, outer to inner::

    mesh_shape: [[2, 2], ["fsdp", "tp"]]

Ranks are laid out row-major over the sizes, so the innermost axis (`tp`) holds consecutive ranks and
stays inside a node.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from parallelkit.compat import flatten_mesh, flattened_meshes, mesh_with_flattened, set_group_timeout
from parallelkit.errors import MeshError

AXES = ("pp", "replicate", "fsdp", "ep", "cp", "tp")
"""Every axis name, in the only order they may appear (outer to inner)."""

DATA_PARALLEL_AXES = ("replicate", "fsdp", "ep")
"""Axes over which ranks see different samples; `pp` and `tp` ranks of one replica share a batch. `ep` (expert
parallel) is data-parallel for every dense parameter, which FSDP shards over `fsdp` x `ep`; the experts of each
mixture-of-experts layer are divided over it instead (`parallelkit.parallel.expert_parallel`)."""

DATA_PARALLEL_MESH = "data_parallel"
"""Name of the flattened axis that `build` adds over every data-parallel axis present (replicate x fsdp x ep)."""

SHARD_AXES = ("fsdp", "ep", "cp")
"""Axes FSDP shards dense parameters over. `cp` (context parallel) ranks hold slices of the same sequences: they
share a batch, as tp ranks do, but each computes gradients from its own tokens, so for the parameters they are
data-parallel (`parallelkit.parallel.context_parallel`)."""

SHARD_MESH = "dp_shard"
"""Name of the flattened axis that `build` adds over the shard axes (`SHARD_AXES`) when the mesh has more than one:
dense parameters are sharded over it."""

EXPERT_SHARD_MESH = "experts_shard"
"""Name of the flattened axis that `build` adds over `fsdp` x `cp` when the mesh has ep and cp: the experts of a rank's
ep coordinate are sharded over it (cp ranks hold the same experts and compute their gradients from other tokens)."""

STAGE_MESH = "stage"
"""The axes of a pipeline stage (every axis but `pp`) flattened: the ranks that share the stage's parameters
(`parallelkit.Muon` gathers each matrix's shards among them)."""

TOKEN_MESH = "dp_cp"
"""Name of the flattened axis that `build` adds over the data-parallel axes and `cp` when the mesh has cp: the ranks
whose tokens differ, over which losses and metrics are summed or averaged."""

LIGHTNING_AXES = {DATA_PARALLEL_MESH: DATA_PARALLEL_AXES, "tensor_parallel": ("tp",)}
"""The axis names of Lightning's ModelParallelStrategy mesh, and the axes each one spans here: a module written for
it (`self.device_mesh["data_parallel"]` in `configure_model`) runs unchanged. The data-parallel one is also the
group parallelkit's samplers and metrics use."""


def _format(sizes: Sequence[int], names: Sequence[str]) -> str:
    return json.dumps([list(sizes), list(names)])


def _show(value: Any) -> str:
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


@dataclass(frozen=True)
class MeshSpec:
    """A validated mesh shape: one size per named axis, outer to inner.

    Build it with `MeshSpec.parse` from the seed format (`[[2, 2], ["fsdp", "tp"]]`, as a Python/YAML
    list or a JSON string), then `resolve` it against the world size before `build`.
    """

    sizes: tuple[int, ...]
    names: tuple[str, ...]

    @classmethod
    def parse(cls, value: MeshSpec | str | Sequence[Any]) -> MeshSpec:
        """Parse `[[sizes...], [names...]]`; checks the form and names, not the world size (see `resolve`)."""
        if isinstance(value, MeshSpec):
            return value
        text = value if isinstance(value, str) else None
        if text is not None:
            try:
                value = json.loads(text)
            except json.JSONDecodeError as err:
                raise MeshError(
                    f"mesh_shape {text!r} is not valid JSON ({err.msg}). Write it as sizes then axis names, "
                    'e.g. \'[[2, 2], ["fsdp", "tp"]]\' (quote it in the shell).'
                ) from None
        shown = text if text is not None else _show(value)
        if (
            not isinstance(value, Sequence)
            or isinstance(value, str)
            or len(value) != 2
            or not all(isinstance(part, Sequence) and not isinstance(part, str) for part in value)
        ):
            raise MeshError(
                f'mesh_shape {shown} must be two lists, sizes then axis names, e.g. [[2, 2], ["fsdp", "tp"]].'
            )
        sizes, names = list(value[0]), list(value[1])
        if len(sizes) != len(names) or not sizes:
            raise MeshError(
                f"mesh_shape {shown} has {len(sizes)} sizes and {len(names)} axis names; give one size per "
                'named axis, e.g. [[2, 2], ["fsdp", "tp"]].'
            )
        for name in names:
            if name not in AXES:
                raise MeshError(
                    f"mesh_shape {shown} names an unknown axis {name!r}. Axis names are {', '.join(AXES)} "
                    "(pipeline, HSDP replicate, fully sharded data parallel, expert parallel, context parallel, tensor "
                    "parallel)."
                )
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise MeshError(
                f"mesh_shape {shown} repeats the axis {repeated[0]!r}. Each axis appears once; to shard over "
                f"more processes, give {repeated[0]!r} one larger size."
            )
        canonical = [axis for axis in AXES if axis in names]
        if names != canonical:
            fixed = [sizes[names.index(axis)] for axis in canonical]
            raise MeshError(
                f"mesh_shape {shown} lists axes as {names}; they go outer to inner as {canonical} "
                f"(tp innermost so it stays inside a node). Fix: {_format(fixed, canonical)}."
            )
        for size in sizes:
            if isinstance(size, bool) or not isinstance(size, int):
                raise MeshError(f"mesh_shape {shown} has a size {size!r} that is not an integer.")
        bad = [(n, s) for s, n in zip(sizes, names) if s < 1 and s != -1]
        if bad:
            name, size = bad[0]
            raise MeshError(
                f"mesh_shape {shown} gives axis {name!r} size {size}; sizes are >= 1, or -1 for one axis "
                "to take what the others leave of the world. Drop an axis you do not use."
            )
        if sizes.count(-1) > 1:
            raise MeshError(
                f"mesh_shape {shown} has {sizes.count(-1)} sizes of -1; at most one axis can take "
                "what is left of the world."
            )
        return cls(tuple(sizes), tuple(names))

    def resolve(self, num_nodes: int, devices: int) -> MeshSpec:
        """Fill a `-1` and check the product against the world (`num_nodes * devices` processes).

        Warns when `tp` is larger than the processes of one node: tensor parallelism communicates in every
        layer's forward and backward, which is slow over the network.
        """
        world_size = num_nodes * devices
        world = f"{world_size} (num_nodes={num_nodes} x devices={devices})"
        sizes = list(self.sizes)
        if -1 in sizes:
            known = math.prod(s for s in sizes if s != -1)
            axis = self.names[sizes.index(-1)]
            if world_size % known:
                raise MeshError(
                    f"mesh_shape {self} cannot fill {axis!r}=-1: the other axes need {known} processes, which "
                    f"does not divide the world size {world}. Fix: {self._suggest(world_size)}."
                )
            sizes[sizes.index(-1)] = world_size // known
        product = math.prod(sizes)
        if product != world_size:
            arithmetic = " x ".join(f"{n}={s}" for n, s in zip(self.names, sizes))
            raise MeshError(
                f"mesh_shape {self} needs {arithmetic} = {product} processes, but the world size is {world}. "
                f"Fix: use mesh_shape {self._suggest(world_size)}, or launch {product} processes."
            )
        resolved = MeshSpec(tuple(sizes), self.names)
        tp = resolved.size("tp")
        if num_nodes > 1 and tp > devices:
            warnings.warn(
                f"mesh_shape {resolved} puts tp={tp} across nodes (devices per node = {devices}): tensor "
                "parallelism communicates in every layer and is slow over the network. Keep tp <= devices "
                "per node and use fsdp/replicate across nodes.",
                stacklevel=2,
            )
        return resolved

    def _suggest(self, world_size: int) -> str:
        """A shape over the same axes that fits `world_size`: every other axis keeps the largest size that
        divides what is left, inner axes first, and the outermost data-parallel axis takes the rest."""
        names = list(self.names)
        absorber = next((names.index(a) for a in ("fsdp", "replicate") if a in names), 0)
        sizes = list(self.sizes)
        left = world_size
        for i in reversed(range(len(sizes))):
            if i != absorber:
                wanted = max(sizes[i], 1)
                sizes[i] = max(d for d in range(1, min(wanted, left) + 1) if left % d == 0)
                left //= sizes[i]
        sizes[absorber] = left
        return _format(sizes, names)

    def size(self, axis: str) -> int:
        """Size of `axis`, 1 when the mesh does not name it."""
        return self.sizes[self.names.index(axis)] if axis in self.names else 1

    @property
    def world_size(self) -> int:
        return math.prod(self.sizes)

    @property
    def cp_size(self) -> int:
        """Context-parallel degree: the ranks each sequence is split over (1 without a cp axis)."""
        return self.size("cp")

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: replicas x shards x expert-parallel ranks, the number of distinct batches per step."""
        return self.size("replicate") * self.size("fsdp") * self.size("ep")

    def coordinates(self, rank: int) -> dict[str, int]:
        """Coordinate of global `rank` on each axis (row-major layout)."""
        if -1 in self.sizes:
            raise MeshError(f"mesh_shape {self} has a -1 left; call resolve(num_nodes, devices) first.")
        coords: dict[str, int] = {}
        for name, size in zip(reversed(self.names), reversed(self.sizes)):
            rank, coords[name] = divmod(rank, size)
        return {name: coords[name] for name in self.names}

    def dp_rank(self, rank: int | None = None) -> int:
        """Index of `rank`'s batch among the `dp_size` data-parallel batches (defaults to this process)."""
        coords = self.coordinates(current_rank() if rank is None else rank)
        index = 0
        for axis in DATA_PARALLEL_AXES:
            index = index * self.size(axis) + coords.get(axis, 0)
        return index

    def build(self, device_type: str, timeout: timedelta | None = None) -> DeviceMesh:
        """Create the DeviceMesh (process groups included); needs the default process group.

        Flattened axes are added under Lightning's names (`LIGHTNING_AXES`): `mesh["data_parallel"]` spans every
        data-parallel axis (the sampler's and metrics' group), `mesh["tensor_parallel"]` is tp; with an `ep` axis,
        `mesh["dp_shard"]` spans `fsdp` x `ep` (what dense parameters are sharded over); with several axes besides `pp`,
        `mesh["stage"]` spans them (`STAGE_MESH`). `timeout`: how long a
        collective on any of the mesh's groups may wait (torch gives the groups a mesh creates its 30-minute default,
        not the default group's timeout); None leaves torch's.
        """
        from torch.distributed.device_mesh import init_device_mesh

        if -1 in self.sizes:
            raise MeshError(f"mesh_shape {self} has a -1 left; call resolve(num_nodes, devices) first.")
        mesh = init_device_mesh(device_type, self.sizes, mesh_dim_names=self.names)
        for name, axes in LIGHTNING_AXES.items():
            present = tuple(axis for axis in axes if axis in self.names)
            if present:
                flatten_mesh(mesh[present], name)
        shard = tuple(axis for axis in SHARD_AXES if axis in self.names)
        if len(shard) > 1:
            flatten_mesh(mesh[shard], SHARD_MESH)
        tokens = tuple(axis for axis in (*DATA_PARALLEL_AXES, "cp") if axis in self.names)
        if "cp" in self.names and len(tokens) > 1:
            flatten_mesh(mesh[tokens], TOKEN_MESH)
        experts = tuple(axis for axis in ("fsdp", "cp") if axis in self.names)
        if "ep" in self.names and len(experts) > 1:
            flatten_mesh(mesh[experts], EXPERT_SHARD_MESH)
        stage = tuple(axis for axis in self.names if axis != "pp")
        if len(stage) > 1:
            flatten_mesh(mesh[stage], STAGE_MESH)
        if timeout is not None:
            groups = [mesh.get_group(name) for name in self.names]
            groups += [flat.get_group() for flat in flattened_meshes(mesh).values()]
            for group in groups:
                set_group_timeout(group, timeout)
        mesh.__class__ = NamedMesh  # the same object, answering to the flattened names too
        return mesh

    def __str__(self) -> str:
        return _format(self.sizes, self.names)


class NamedMesh(DeviceMesh):
    """A built mesh, which also answers to the names of the axes `build` flattened (`data_parallel`,
    `tensor_parallel`) with the meshes kept for them. (torch slices a flattened axis from the root mesh by name too,
    but warns that this is deprecated and that callers should keep the flattened meshes themselves.)"""

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str) and names not in (self.mesh_dim_names or ()):
            flattened = flattened_meshes(self)
            if names in flattened:
                return flattened[names]
        return super().__getitem__(names)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The sub-mesh spanning every data-parallel rank of `mesh`, or None when it has no dp axis."""
    names = mesh.mesh_dim_names or ()
    present = [axis for axis in DATA_PARALLEL_AXES if axis in names]
    if len(present) > 1:
        return mesh[DATA_PARALLEL_MESH]
    return mesh[present[0]] if present else None


def dense_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh FSDP shards dense parameters over: the data-parallel axes and cp, 2-D (replicate, shard) for HSDP,
    where the shard axis is the shard axes flattened (`SHARD_MESH`) when the mesh has several; None without any."""
    names = mesh.mesh_dim_names or ()
    shard = [axis for axis in SHARD_AXES if axis in names]
    shard_name = SHARD_MESH if len(shard) > 1 else (shard[0] if shard else None)
    if "replicate" in names and shard_name is not None:
        return mesh_with_flattened(mesh, ("replicate", shard_name))
    if "cp" in names:
        return mesh[shard_name]
    return data_parallel_mesh(mesh)


def expert_data_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh FSDP shards experts over: the data-parallel axes other than `ep`, and cp (`EXPERT_SHARD_MESH` when
    both fsdp and cp are there), 2-D for HSDP; None without an ep axis, or when there are none of those (each rank
    then holds its experts whole)."""
    names = mesh.mesh_dim_names or ()
    if "ep" not in names:
        return None
    shard = [axis for axis in ("fsdp", "cp") if axis in names]
    axes = ["replicate"] if "replicate" in names else []
    axes += [EXPERT_SHARD_MESH] if len(shard) > 1 else shard
    if len(axes) == 2:
        return mesh_with_flattened(mesh, tuple(axes))
    return mesh[axes[0]] if axes else None


def stage_group(mesh: DeviceMesh | None) -> Any:
    """The process group of the ranks sharing this rank's parameters (every axis but `pp`); None with no mesh or
    none of those axes."""
    names = tuple(axis for axis in (mesh.mesh_dim_names or ()) if axis != "pp") if mesh is not None else ()
    if not names:
        return None
    return mesh[names[0] if len(names) == 1 else STAGE_MESH].get_group()


def current_rank() -> int:
    """Global rank of this process: from the process group if up, else from the launcher's environment."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def is_main(rank: int | None = None) -> bool:
    """True on global rank 0, the process that writes shared files and prints summaries."""
    return (current_rank() if rank is None else rank) == 0


def is_local_main(local_rank: int | None = None) -> bool:
    """True on each node's local rank 0, the process that prepares node-local files."""
    return (int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank) == 0


def data_parallel_size(strategy: Any) -> int:
    """Number of distinct batches per step: a parallelkit mesh's dp size, else every process."""
    spec = getattr(strategy, "mesh_spec", None)
    return spec.dp_size if spec is not None else strategy.world_size


def reduction_size(strategy: Any) -> int:
    """Number of ranks whose gradients the reduction averages: the data-parallel ranks times the cp ranks, each of
    which computes gradients from its own slice of the sequences."""
    spec = getattr(strategy, "mesh_spec", None)
    return spec.dp_size * spec.cp_size if spec is not None else strategy.world_size


def token_group(strategy: Any) -> Any:
    """Process group over which a strategy's tokens differ: the data-parallel group, with the cp ranks when the mesh
    splits sequences (their losses and metrics are parts of one batch's). None: the whole world."""
    mesh = getattr(strategy, "device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "cp" not in names:
        return data_parallel_group(strategy)
    present = [axis for axis in (*DATA_PARALLEL_AXES, "cp") if axis in names]
    return mesh[TOKEN_MESH if len(present) > 1 else "cp"].get_group()


def data_parallel_group(strategy: Any) -> Any:
    """Process group over which a strategy's batches differ (for loss logging and metrics).

    A strategy with a `device_mesh` gives its data-parallel sub-mesh's group; otherwise None, which torch and
    Lightning read as the whole world: right for DDP and a single device, where every rank is data-parallel.
    """
    mesh = getattr(strategy, "device_mesh", None)
    dp = data_parallel_mesh(mesh) if mesh is not None else None
    return dp.get_group() if dp is not None else None
