"""The gradients' reduction across replica groups: one flat all-reduce after backward, or, for FSDP2 units, one per
unit started as backward produces it.

Under FSDP2 a unit's sharded gradients are views of one flat buffer, written whole by the unit's reduce-scatter
(divided, cast to the parameters' dtype) before FSDP hands any of them to the parameters' post-accumulate-grad
hooks. `OverlappedReduce` hooks every trained parameter: when the hooks move on to another buffer (FSDP reached the
next unit), the one before is complete and its all-reduce across the groups starts, through torchft's manager,
while backward goes on with the layers below; `finish` sends the last, waits for all, and leaves what no unit covered
(parameters outside FSDP) to the flat all-reduce. Buffers of another dtype than fp32 travel as fp32 copies: nothing is
summed in bf16.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from parallelkit.compat import local_shard, view_base


def reduce_op(name: Any) -> Any:
    """torch's `ReduceOp` for a Lightning-style name ("mean", "sum", "max", "min") or a `ReduceOp` itself."""
    from torch.distributed import ReduceOp

    if isinstance(name, ReduceOp.RedOpType):
        return name
    ops = {"mean": ReduceOp.AVG, "avg": ReduceOp.AVG, "sum": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN}
    return ops[str(name).lower()]


def flat_all_reduce(manager: Any, grads: list[torch.Tensor], op: str) -> None:
    """`grads` (local tensors) all-reduced across the step's groups in one fp32 buffer, written back in place."""
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    manager.allreduce(flat, reduce_op=reduce_op(op)).wait()
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class OverlappedReduce:
    """Each FSDP2 unit's gradient buffer all-reduced across the step's groups as soon as backward has written it
    (module docstring). `op` gives the step's reduction ("mean", or "sum" for token batches) as a buffer is sent."""

    def __init__(self, manager: Any, parameters: list[torch.nn.Parameter], op: Callable[[], str]) -> None:
        self.manager, self.op = manager, op
        self.fraction = 0.0  # of the last step's gradient elements, those reduced during backward
        self._current: torch.Tensor | None = None  # the buffer whose gradients FSDP is handing out
        self._sent: list[tuple[torch.Tensor, torch.Tensor, Any]] = []  # (buffer, what travels, its work)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_gradient) for p in parameters]

    def _on_gradient(self, param: torch.nn.Parameter) -> None:
        local = local_shard(param.grad)
        buffer = view_base(local)
        if buffer is local or buffer is self._current:  # not a unit's buffer; or the one being handed out
            return
        if self._current is not None:
            self._send(self._current)
        self._current = buffer

    def _send(self, buffer: torch.Tensor) -> None:
        if any(buffer is sent for sent, _, _ in self._sent):
            return
        travelling = buffer if buffer.dtype == torch.float32 else buffer.float()
        self._sent.append((buffer, travelling, self.manager.allreduce(travelling, reduce_op=reduce_op(self.op()))))

    def finish(self, parameters: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
        """Send the last buffer, wait for every one sent this step, and return the local gradients of `parameters`
        that none held (for the flat all-reduce)."""
        if self._current is not None:
            self._send(self._current)
        for buffer, travelling, work in self._sent:
            work.wait()
            if travelling is not buffer:
                buffer.copy_(travelling)
        sent = [buffer for buffer, _, _ in self._sent]
        self._current, self._sent = None, []
        grads = [local_shard(p.grad) for p in parameters if p.grad is not None]
        rest = [g for g in grads if not any(view_base(g) is buffer for buffer in sent)]
        total = sum(g.numel() for g in grads)
        self.fraction = 1.0 - sum(g.numel() for g in rest) / total if total else 0.0
        return rest

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
