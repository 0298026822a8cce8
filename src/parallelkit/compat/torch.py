"""torch's private names: process groups (the fake one, timeouts, lookup by name), a module's forward and
parameters, device meshes' flattened axes, composable activation checkpointing, autograd's state, functional
collectives, kernels without a public name, tensor storage, DTensor shards and DCP's metadata pickle."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn import Module


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """torch's fake process group as the default group, for `rank` of `world_size`: collectives return at once and
    move nothing, so one process can build any rank's mesh and shard a meta model as that rank would (torch's test
    utility `torch.testing._internal.distributed.fake_pg`, which registers the "fake" backend)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def set_group_timeout(group: Any, timeout: timedelta) -> None:
    """Make collectives on `group` (None: the default group) fail after `timeout` (torch's `_set_pg_timeout`)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def process_group_named(name: str) -> Any:
    """The process group a functional collective names by its `group_name` (torch's `_resolve_process_group`)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def run_as_forward(module: Module, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call `module.<method>(*args, **kwargs)` through `module(...)`, so that its forward hooks run around it (what
    Lightning's `_ForwardRedirection` does for its DDP and FSDP1 wrappers).

    Inside, calling the module itself (`self(x)` in a training_step) runs its `forward` alone, not its hooks again:
    FSDP2's, nested, would leave the root's parameter group idle at the inner call's end, so that the outer call's
    end frees the root's gathered parameters and backward gathers them a second time. nn.Module's call runs
    `_compiled_call_impl` instead of its hooks when one is set (what `Module.compile()` sets).
    """
    step = getattr(module, method)
    own_forward = vars(module).get("forward")  # an instance's own forward, else the class's

    def restore_forward() -> None:
        if own_forward is not None:
            module.forward = own_forward
        else:
            vars(module).pop("forward", None)

    def forward(*inner_args: Any, **inner_kwargs: Any) -> Any:
        restore_forward()
        compiled = module._compiled_call_impl
        module._compiled_call_impl = module.forward
        try:
            return step(*inner_args, **inner_kwargs)
        finally:
            module._compiled_call_impl = compiled

    module.forward = forward
    try:
        return module(*args, **kwargs)
    finally:
        restore_forward()  # also when a hook failed before the forward ran


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """One mesh axis named `name` spanning every axis of `mesh` (a sub-mesh of the root). torch 2.13:
    `DeviceMesh._flatten`, the only way to get one group spanning several mesh axes."""
    return mesh._flatten(name)


def mesh_with_flattened(root: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The sub-mesh of `root` over `names`, some of them axes `flatten_mesh` made (HSDP over (replicate, fsdp x ep)).
    torch 2.13 slices those from the root mesh and warns that it will stop: there is no other way to get a 2-D mesh
    whose second axis is a flattened one. The warning is silenced here only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
        return root[names]


def flattened_meshes(root: DeviceMesh) -> dict[str, DeviceMesh]:
    """The meshes `flatten_mesh` made from `root`, by name (torch keeps them on the root mesh)."""
    return root._flatten_mapping


def composable_checkpoint(module: Module) -> None:
    """Recompute `module`'s activations in backward, keeping its parameter names (torch's composable
    `checkpoint`, which the public `torch.utils.checkpoint` has no module form of)."""
    from torch.distributed._composable import checkpoint

    checkpoint(module)


def checkpointed_submodules(module: Module) -> list[Module]:
    """The modules under `module` (itself included) that `composable_checkpoint` made recompute their activations."""
    from torch.distributed._composable.contract import _get_registry

    return [m for m in module.modules() if "checkpoint" in (_get_registry(m) or {})]


def recomputing(module: Module) -> bool:
    """Whether a checkpointed `module`'s forward now running is backward's recomputation (torch's composable
    checkpoint turns its own hooks off for it)."""
    from torch.distributed._composable import checkpoint

    return not checkpoint.state(module).enable_hook


def saved_tensors_hooks_in_force() -> tuple[Any, Any] | None:
    """The (pack, unpack) pair autograd calls now, the innermost `saved_tensors_hooks`; None when there are none."""
    import torch

    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def grouped_mm(x: Any, weight: Any, offsets: Any) -> Any:
    """`x` (rows grouped by expert, group `g` ending at row `offsets[g]`) times `weight[g]` (E, in, out) per group.
    torch 2.13: `torch._grouped_mm` (no public name yet; CUDA and CPU kernels, differentiable)."""
    import torch

    return torch._grouped_mm(x, weight, offs=offsets)


def grouped_mm_runs(x: Any, weight: Any) -> bool:
    """Whether `grouped_mm` takes these operands: the kernel wants fp32/bf16 rows 16-byte aligned, plain tensors."""
    import torch

    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16) or x.dtype != weight.dtype:
        return False
    per_16_bytes = 16 // x.element_size()
    return all(size % per_16_bytes == 0 for size in weight.shape[1:]) and type(weight) is type(x)


def registered_parameters(module: Module) -> dict[str, Any]:
    """`module`'s own parameters by name, as the dict it looks them up in: a tensor put there is what the module's
    forward sees under that name, without registration (FSDP2 swaps gathered parameters in the same way). torch:
    `nn.Module._parameters`."""
    return module._parameters


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (as when activation checkpointing recomputes a forward).
    torch 2.13: `torch._C._current_graph_task_id()`, -1 outside a backward."""
    import torch

    return torch._C._current_graph_task_id() != -1


def all_to_all_autograd(tensor: Any, output_sizes: list[int], input_sizes: list[int], group: Any) -> Any:
    """Rows of `tensor` exchanged within `group` (`input_sizes` rows to each rank, `output_sizes` from each), with a
    backward that sends the gradients back. torch 2.13: `_functional_collectives.all_to_all_single_autograd` (the
    public `torch.distributed.nn.functional.all_to_all_single` is deprecated in its favour)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(tensor, output_sizes, input_sizes, group))


def settle_async_collectives(tree: Any) -> Any:
    """`tree` with every `AsyncCollectiveTensor` (what a tensor-parallel style's `to_local()` returns while its
    collective may still run) replaced by a plain copy of its value that autograd links to it.

    A compiled region takes plain tensors: handed an AsyncCollectiveTensor (e.g. the embedding's output, under tensor
    parallelism) as an input, torch 2.13's AOTAutograd routes the input's gradient past the wrapper's backward into
    the DTensor redistribution before it, which then fails on a plain tensor or, under FSDP, yields wrong gradients.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.utils._pytree import tree_map_only

    return tree_map_only(AsyncCollectiveTensor, lambda tensor: tensor.clone(), tree)


def saved_tensors_hooks_active() -> bool:
    """Whether a `torch.autograd.graph.saved_tensors_hooks` context is active (the innermost one's hooks exist)."""
    import torch

    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


def keep_profiler_ranges() -> Any:
    """A context in which torch.compile traces `record_function` ranges into its graph (an optimizer's
    "Optimizer.step#AdamW.step"), where by default it drops them with a warning."""
    import torch._dynamo

    return torch._dynamo.config.patch(capture_profiler_record_function=True)


def keep_scheduler_mark(new: Any, old: Any) -> None:
    """Give the function replacing an optimizer's `step` the mark an LR scheduler left on the old one, if any (the
    scheduler warns at its first step when the mark is gone, and wraps a step without it)."""
    if hasattr(old, "_wrapped_by_lr_sched"):
        new._wrapped_by_lr_sched = True


def dispatch_mode_class() -> type:
    """torch's `TorchDispatchMode`: sees every aten op, the c10d collectives included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def storage_key(tensor: Tensor) -> tuple[int, int]:
    """The identity and size of the storage `tensor` (or a DTensor's local shard) lives in. Identity, not address:
    every meta tensor sits at address 0."""
    from torch.distributed.tensor import DTensor

    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    storage = local.untyped_storage()
    return storage._cdata, storage.nbytes()


def view_base(tensor: Tensor) -> Tensor:
    """The tensor `tensor` is a view of, or itself."""
    return tensor._base if tensor._base is not None else tensor


def apply_to_tensors(module: Module, fn: Any) -> None:
    """Replace every parameter and buffer `t` of `module` by `fn(t)` in place, keeping Parameter objects
    (`nn.Module._apply`, which `to()` and `to_empty()` are made of; those apply to every tensor alike)."""
    module._apply(fn)


def flash_attention_on_cpu(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None) -> Tensor:
    """The output of the fused (flash) SDPA kernel for CPU, whatever the device of q, k, v (meta included)."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)[0]


def local_box(tensor: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """This rank's part of `tensor` and where it starts in the whole: a DTensor's local shard and its global
    offsets (DTensor's DCP protocol, `__create_chunk_list__`, which also places FSDP-over-TP strided shards), or a
    plain tensor whole at offset 0."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, (0,) * tensor.ndim
    (chunk,) = tensor.__create_chunk_list__()
    return tensor.to_local(), tuple(chunk.offsets)


def local_shard(tensor: Tensor) -> Tensor:
    """This rank's part of `tensor`: a DTensor's local shard (outside autograd the shard itself, so in-place updates
    change the DTensor), or a plain tensor itself."""
    return local_box(tensor)[0]


def dcp_metadata_global(module: str, name: str) -> Any | None:
    """The object a DCP `.metadata` pickle may name as `module.name`, or None for anything else.

    DCP pickles its `Metadata` dataclass tree: the classes of `torch.distributed.checkpoint.metadata` (its
    `_MEM_FORMAT_ENCODING` enum among them), the file reader's `_StorageInfo` (where each item's bytes lie), tensor
    sizes (`torch.Size`), dtypes (`torch.float32`: a torch attribute), layouts (rebuilt by `torch.serialization.
    _get_layout` from their name; it returns layouts only) and the checkpoint's path (`pathlib`). Nothing here runs
    code chosen by the file: constructing these with any arguments stores them.
    """
    import pathlib

    import torch
    import torch.distributed.checkpoint.metadata as dcp_metadata
    from torch.distributed.checkpoint import filesystem

    if module == dcp_metadata.__name__:
        found = getattr(dcp_metadata, name, None)
        return found if isinstance(found, type) and found.__module__ == module else None
    if module == "torch":
        found = getattr(torch, name, None)
        plain = isinstance(found, (torch.dtype, torch.layout, torch.memory_format))
        return found if plain or found is torch.Size else None
    exact = {
        (filesystem.__name__, "_StorageInfo"): filesystem._StorageInfo,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        **{("pathlib", path.__name__): path for path in (pathlib.PosixPath, pathlib.WindowsPath)},
        **{("pathlib", path.__name__): path for path in (pathlib.PurePosixPath, pathlib.PureWindowsPath)},
    }
    return exact.get((module, name))


def model_class_name(model: Module) -> str:
    """The model's own class name (fully_shard swaps in a generated `FSDP<Name>` subclass)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def muon_orthogonalize(update: Tensor, coefficients: Any, steps: int, eps: float) -> Tensor:
    """torch's Muon's Newton-Schulz orthogonalisation of a matrix (`torch.optim._muon._zeropower_via_newtonschulz`:
    in bf16, its result bf16), so a distributed Muon computes exactly what `torch.optim.Muon` does."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(update, coefficients, steps, eps)


def muon_adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Any) -> float:
    """torch's Muon's learning rate for a matrix of `shape` (`torch.optim._muon._adjust_lr`)."""
    from torch.optim._muon import _adjust_lr

    return _adjust_lr(lr, adjust_lr_fn, shape)
