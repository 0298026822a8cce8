"""Expert parallelism: the experts of every mixture-of-experts layer divided over the `ep` mesh axis.

Each rank of an ep group holds `num_experts / ep` whole experts (its parameters become `Shard(0)` DTensors on the ep
mesh, which FSDP then shards over the remaining data-parallel axes), and every experts module's forward is replaced
by a dispatch (`ExpertDispatch`), dropless:

1. the router has already chosen each token's experts and weights (the family's own router, in the MoE block);
2. the token copies, sorted by expert, go to the ranks holding their experts in one `all_to_all_single` with split
   sizes (the counts go first, in one of fixed size);
3. the module's own forward runs there on the experts this rank holds (transformers' grouped GEMM kernel for its
   families, parallelkit's for the GPT), each copy with weight 1, with their LoRA adapters if they have some
   (`parallelkit.contract.EXPERT_WEIGHTS_HOOK`: the adapters are the module's parameters, divided with them);
4. the outputs come back by the reverse all-to-all and are summed per token with the router's weights, in expert
   order, as the module itself sums them.

Gradients: an expert's gradient on its rank sums the contributions of the whole ep group's tokens (the all-to-all's
backward brings them), where a dense parameter's is averaged over the data-parallel ranks; the local expert weights
scale their gradient by 1 / ep, so that after FSDP's average over the other data-parallel axes every parameter has
the gradient of the global batch's mean loss, as on one process.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from parallelkit.compat import all_to_all_autograd, in_backward, registered_parameters
from parallelkit.contract import EXPERT_WEIGHTS_HOOK

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from parallelkit.parallel.resolve import ResolvedPlan


def apply_expert_parallel(root: nn.Module, ep_mesh: DeviceMesh, resolved: ResolvedPlan) -> list[nn.Module]:
    """Divide the experts of every experts module `root` holds over the 1-D `ep_mesh`, in place; returns them."""
    held = dict(root.named_modules())
    modules = [held[fqn] for fqn in resolved.experts if fqn in held]
    for module in modules:
        ExpertDispatch(module, ep_mesh)
    return modules


class ExpertDispatch:
    """The forward of one experts module whose experts are divided over an ep group (see the module docstring).

    Installed as the module's `forward` (and as its `expert_dispatch`); the module's class forward computes the
    experts this rank holds, with `num_experts` set to their count. `computed` counts the token copies this rank's
    experts computed in training forward passes (not in eval mode: the sanity check and validation; not an
    activation-checkpoint recompute), for the monitors.
    """

    def __init__(self, module: nn.Module, ep_mesh: DeviceMesh) -> None:
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor

        self.ep = ep_mesh.size()
        self.group = ep_mesh.get_group()
        self.num_experts = module.num_experts
        self.local_experts = self.num_experts // self.ep
        self.compute = type(module).forward
        self.signature = inspect.signature(self.compute)
        self.computed = 0
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                # src_data_rank=None: each rank keeps its slice of its own copy (they are equal: one seed), no send.
                local = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
                module.register_parameter(name, nn.Parameter(local, requires_grad=param.requires_grad))
        module.num_experts = self.local_experts
        module.forward = self.forward_of(module)
        module.expert_dispatch = self

    def forward_of(self, module: nn.Module) -> Callable[..., torch.Tensor]:
        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            bound = self.signature.bind(module, *args, **kwargs)
            hidden, index, weights = list(bound.arguments.values())[1:4]
            return self.dispatch(module, hidden, index, weights)

        return forward

    def dispatch(
        self, module: nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        import torch.distributed as dist

        k = index.shape[-1]
        flat = index.reshape(-1)
        order = flat.argsort(stable=True)  # token copies by expert, each expert's in token order
        counts = torch.bincount(flat, minlength=self.num_experts)
        received_counts = torch.empty_like(counts)  # (source rank, local expert), flattened
        dist.all_to_all_single(received_counts, counts, group=self.group)
        send = counts.view(self.ep, self.local_experts).sum(1).tolist()
        receive = received_counts.view(self.ep, self.local_experts).sum(1).tolist()
        token = order // k
        received = _all_to_all(hidden.index_select(0, token), receive, send, self.group)
        experts = torch.arange(self.local_experts, device=flat.device).repeat(self.ep)
        local = experts.repeat_interleave(received_counts)
        self.computed += local.numel() if module.training and not in_backward() else 0
        by_expert = local.argsort(stable=True)
        computed = self.run_local(module, received.index_select(0, by_expert), local.index_select(0, by_expert))
        back = computed.index_select(0, by_expert.argsort())
        returned = _all_to_all(back, send, receive, self.group)
        weighted = returned * weights.reshape(-1).index_select(0, order)[:, None]
        return torch.zeros_like(hidden).index_add_(0, token, weighted.to(hidden.dtype))

    def run_local(self, module: nn.Module, tokens: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The module's own forward on the tokens sent to this rank, each with its (local) expert and weight 1."""
        ones = torch.ones(tokens.shape[0], 1, dtype=tokens.dtype, device=tokens.device)
        adapted = getattr(module, EXPERT_WEIGHTS_HOOK, nullcontext)  # LoRA on the experts: W + B @ A
        with _local_weights(module, 1.0 / self.ep) as used, adapted():
            out = self.compute(module, tokens, experts[:, None], ones)
            if tokens.shape[0] == 0:  # no token came: the weights still get their (zero) gradient, as on one process
                out = out + sum(weight.sum() * 0 for weight in used)
        return out


@contextmanager
def _local_weights(module: nn.Module, grad_scale: float) -> Iterator[list[torch.Tensor]]:
    """The module's DTensor parameters as this rank's plain local tensors while its forward runs, their gradients
    scaled by `grad_scale` (what parameters FSDP has gathered are the ones seen)."""
    from torch.distributed.tensor import DTensor

    registered = registered_parameters(module)
    saved = dict(registered)
    local = {
        name: _ScaleGrad.apply(param.to_local(), grad_scale)
        for name, param in saved.items()
        if isinstance(param, DTensor)
    }
    registered.update(local)
    try:
        yield [weight for weight in local.values() if weight.requires_grad]  # not an NF4 base's bytes
    finally:
        registered.update({name: saved[name] for name in local})


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _all_to_all(tensor: torch.Tensor, output_sizes: list[int], input_sizes: list[int], group: Any) -> torch.Tensor:
    """Rows of `tensor` sent to each rank of `group` (`input_sizes` rows to each, in rank order) and received from
    each (`output_sizes`), differentiable (the backward sends the gradients back the same way)."""
    return all_to_all_autograd(tensor.contiguous(), output_sizes, input_sizes, group)
