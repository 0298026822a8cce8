"""Communication-precision hooks: how a strategy reduces gradients across data-parallel ranks.

A hook is found by name (`comm_precision: bf16`) among the `parallelkit.comm_hooks` entry points (the
built-ins register there too) or passed as an object. Strategies apply it to every FSDP2 module: the
reduce-scatter over `fsdp` and, for HSDP, the all-reduce over `replicate` run in `reduce_dtype`, and a
hook may replace the reduce-scatter itself (`configure`). Pipeline send/recv of activations and gradients
stay in the compute dtype; tensor-parallel collectives are not gradient reductions and are untouched.
`parallelkit.DDPStrategy` applies a hook's DDP form (`ddp_hook`) to Lightning's DDP on any device.
"""

from __future__ import annotations

from typing import Any

import torch

from parallelkit.errors import ConfigError


class CommHook:
    """Base class of communication-precision hooks.

    Subclass it, set `reduce_dtype` (the dtype gradients are reduced in) and, to change the collective itself,
    override `configure` (called once per FSDP2 module after sharding). Register the class under the
    `parallelkit.comm_hooks` entry point to make it selectable by name.
    """

    name: str = "custom"
    reduce_dtype: torch.dtype | None = torch.float32
    bytes_ratio: float = 1.0
    """Bytes on the wire relative to an fp32 reduction (what the hook claims and the tests hold it to)."""

    def configure(self, module: Any) -> None:
        """Adjust one FSDP2 module's gradient communication (default: nothing beyond `reduce_dtype`)."""

    def ddp_hook(self) -> Any:
        """The hook's form for DDP's `register_comm_hook` (state: the process group), or None if it has none."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, reduce_dtype={self.reduce_dtype})"


class FP32(CommHook):
    """Gradients reduced in fp32 (the default): exact, 4 bytes per gradient element."""

    name = "fp32"
    reduce_dtype = torch.float32

    def ddp_hook(self) -> Any:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook


class BF16(CommHook):
    """Gradients cast to bf16 for the reduction, then accumulated into fp32 shards: half the bytes, ~3
    significant digits per reduced element. No overflow risk (fp32's range)."""

    name = "bf16"
    reduce_dtype = torch.bfloat16
    bytes_ratio = 0.5

    def ddp_hook(self) -> Any:
        return cast_allreduce_hook(torch.bfloat16)


class FP16(CommHook):
    """Gradients reduced in fp16: half the bytes, more mantissa than bf16 but a narrow range, so FSDP2 divides
    before and after the sum (by about sqrt(world size) each) so that it cannot overflow."""

    name = "fp16"
    reduce_dtype = torch.float16
    bytes_ratio = 0.5

    def ddp_hook(self) -> Any:
        return cast_allreduce_hook(torch.float16)


def cast_allreduce_hook(dtype: torch.dtype) -> Any:
    """A DDP comm hook that all-reduces each gradient bucket in `dtype`, dividing by the world size first.

    torch ships the same algorithm as `bf16_compress_hook`, but DDP refuses that one unless it runs on CUDA
    with NCCL; this one runs on any backend that reduces `dtype` (gloo included).
    """
    import torch.distributed as dist

    # No annotations: DDP compares them with dist.GradBucket / Future, and this module's are strings.
    def hook(state, bucket):
        group = state if state is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size(group))
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(done: Any) -> torch.Tensor:
            buffer.copy_(done.value()[0])
            return buffer

        return future.then(decompress)

    return hook


def resolve(hook: str | CommHook | None) -> CommHook:
    """The hook for a strategy's `comm_precision`: None means fp32; a name is looked up among the plugins."""
    if hook is None:
        return FP32()
    if isinstance(hook, CommHook):
        return hook
    from parallelkit.plugins import comm_hooks

    available = comm_hooks()
    if hook not in available:
        raise ConfigError(
            f"comm_precision={hook!r} names no installed comm hook; available: {', '.join(sorted(available))}. "
            "Third-party hooks register under the 'parallelkit.comm_hooks' entry point."
        )
    obj = available[hook].obj
    instance = obj() if isinstance(obj, type) else obj
    if not isinstance(instance, CommHook):
        raise ConfigError(
            f"comm hook {hook!r} from {available[hook].origin} is {instance!r}, not a parallelkit.comm.CommHook."
        )
    return instance


__all__ = ["BF16", "FP16", "FP32", "CommHook", "cast_allreduce_hook", "resolve"]


def reduce_logged(tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
    """What Lightning's `Strategy.reduce` does with a `sync_dist` value (an all-reduce over `group`, in place; "mean"
    as SUM then a division on gloo, which has no AVG), without the barrier Lightning runs before it: a blocking
    round trip per logged value per step, which the all-reduce itself makes redundant."""
    import torch.distributed as dist

    if not isinstance(tensor, torch.Tensor) or not dist.is_available() or not dist.is_initialized():
        return tensor
    group = dist.group.WORLD if group is None else group
    divide = False
    if isinstance(reduce_op, str):
        name = "avg" if reduce_op.lower() == "mean" else reduce_op.lower()
        divide = name == "avg" and dist.get_backend(group) == "gloo"
        reduce_op = dist.ReduceOp.SUM if divide else getattr(dist.ReduceOp, name.upper())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if reduce_op is None else reduce_op, group=group)
    if not divide:
        return tensor
    size = dist.get_world_size(group)
    return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)
