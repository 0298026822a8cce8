"""Mixture-of-experts routing per optimizer step: tokens per expert, their imbalance, dropped tokens."""

from __future__ import annotations

import inspect
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from parallelkit.compat import in_backward, should_accumulate
from parallelkit.parallel.resolve import resolve


class ExpertMonitor(L.Callback):
    """Logs, every optimizer step, how the routers of a mixture-of-experts model spread the global batch:

    - `moe/tokens_expert_<e>`: token copies routed to expert `e` (summed over the MoE layers and every rank);
    - `moe/imbalance`: the busiest expert's copies over the mean, per layer, averaged over the layers (1 is even);
    - `moe/dropped`: copies routed but not computed. Zero: routing is dropless (under expert parallelism it is
      measured, the copies the experts' ranks computed against those the routers sent; transformers' own expert loop
      computes every copy it is given).

    The experts modules are the model plan's (`ParallelPlan.experts`); their routed expert ids are read from their
    calls (`top_k_index`), so the monitor works with and without an `ep` axis. Training forwards only (the module in
    train mode): the sanity check and validation route tokens too, and an activation-checkpoint recompute routes
    them again; neither is counted, here or in the dispatch's `computed`.
    One all-reduce over every rank per step (tensor-parallel ranks, which route the same tokens, are counted once).
    """

    def __init__(self) -> None:
        self._counts: dict[str, torch.Tensor] = {}
        self._names: list[str] = []
        self._experts = 1
        self._hooks: list[Any] = []
        self._dispatches: list[Any] = []  # the experts modules' `ExpertDispatch`es, under expert parallelism

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        resolved = getattr(trainer.strategy, "resolved", None) or resolve(pl_module)
        self._names = list(resolved.experts)
        held = dict(pl_module.named_modules())
        self._dispatches = [m.expert_dispatch for m in held.values() if getattr(m, "expert_dispatch", None)]
        for name in self._names:
            count = getattr(getattr(held.get(name), "expert_dispatch", held.get(name)), "num_experts", None)
            if isinstance(count, int):  # and held: a pipeline rank holds its stage's layers
                self._experts = count
                module = held[name]
                self._hooks.append(module.register_forward_pre_hook(self._counter(name, module), with_kwargs=True))

    def _counter(self, name: str, module: torch.nn.Module) -> Any:
        signature = inspect.signature(type(module).forward)

        def count(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if in_backward() or not module.training:
                return  # activation checkpointing recomputing the forward, or validation
            index = list(signature.bind(module, *args, **kwargs).arguments.values())[2]
            counts = torch.bincount(index.detach().reshape(-1), minlength=self._experts).double()
            self._counts[name] = self._counts.get(name, 0) + counts

        return count

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._names or should_accumulate(trainer):
            return
        device = trainer.strategy.root_device
        table = torch.zeros(len(self._names), self._experts, dtype=torch.float64)
        computed = 0.0
        for row, name in enumerate(self._names):
            if name in self._counts:
                table[row] = self._counts[name].cpu()
        for dispatch in self._dispatches:
            computed += dispatch.computed
            dispatch.computed = 0
        routed_here = table.sum().item()
        if not self._dispatches:
            computed = routed_here  # transformers' own loop computes every copy it is given
        local = torch.cat([table.flatten(), torch.tensor([routed_here - computed], dtype=torch.float64)]).to(device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(local)
        tp = getattr(getattr(trainer.strategy, "mesh_spec", None), "size", lambda _axis: 1)("tp")
        everyone = local.cpu() / tp
        table, dropped = everyone[:-1].view(len(self._names), self._experts), everyone[-1].item()
        self._counts.clear()
        used = table[table.sum(dim=1) > 0]
        imbalance = (used.max(dim=1).values / used.mean(dim=1)).mean().item() if len(used) else 1.0
        metrics = {f"moe/tokens_expert_{e}": value for e, value in enumerate(table.sum(dim=0).tolist())}
        metrics |= {"moe/imbalance": imbalance, "moe/dropped": dropped}
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, rank_zero_only=True)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
