"""Muon on the hidden matrices and AdamW on the rest, exact under every parallelkit layout.

Muon (torch's `torch.optim.Muon`) updates a matrix with its momentum orthogonalised by a Newton-Schulz iteration.
The iteration needs the whole matrix: under FSDP, tp or ep each rank holds a shard, and orthogonalising a shard is
not orthogonalising the matrix. Here every matrix is orthogonalised exactly once a step, whole, on one rank of the
ranks that share it (its owner; the matrices are spread over the ranks by size, so the work divides): each rank
sends the owner its shard of the matrix's momentum update, the owner puts the shards together, orthogonalises
(torch's own Newton-Schulz, in bf16 as torch's Muon does) and sends each rank its shard of the result back, in
bf16. A pipeline stage does its own matrices, among its own ranks. The rest of the step is torch's Muon's, on each
rank's shards: the momentum, the learning rate adjusted by the whole matrix's shape, the decoupled weight decay.

Which parameters are Muon's (`hidden_matrices`): the weight of every linear layer except the output layer (the
layer the model's plan gives the `vocab_head` style), LoRA's adapters, and the stacked parameters of experts
modules, each expert's slice a matrix of its own. Embeddings, norms, biases and the output layer take AdamW
(torch's `torch.optim.AdamW`, run on them as it runs). `matrices` (globs over parameter names) replaces the rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallelkit.compat import local_box, local_shard, muon_adjusted_lr, muon_orthogonalize
from parallelkit.contract import matches_suffix
from parallelkit.errors import ConfigError

MUON_DEFAULTS = {"ns_coefficients": (3.4445, -4.7750, 2.0315), "eps": 1e-7, "ns_steps": 5}
"""torch's Muon's Newton-Schulz settings (the quintic of Keller Jordan's Muon)."""


def hidden_matrices(model: nn.Module, matrices: list[str] | None = None) -> list[str]:
    """Names of the trainable parameters of `model` Muon updates: those `matrices` (globs over parameter names, `*`
    one segment) match, or by default the weight of every linear layer but the output layer (the plan's
    `vocab_head`), LoRA adapters, and experts modules' stacked parameters (each expert's slice a matrix)."""
    from parallelkit.adapters.lora import ADAPTER_PARAMETERS, output_layers

    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    if matrices is not None:
        chosen = [name for name, _ in named if any(matches_suffix(glob, name) for glob in matrices)]
        shapes = {name: tuple(param.shape) for name, param in named}
        wrong = [name for name in chosen if len(shapes[name]) not in (2, 3)]
        if wrong:
            raise ConfigError(
                f"optimizer.matrices={matrices} names {wrong[0]} {list(shapes[wrong[0]])}: Muon updates matrices "
                "(2-D, or an experts parameter's 3-D stack of them). Fix: narrow the globs to weights of linear "
                "layers and experts' stacked parameters."
            )
        return chosen
    heads = output_layers(model)
    modules = dict(model.named_modules())
    chosen = []
    for name, param in named:
        owner, _, attr = name.rpartition(".")
        module = modules.get(owner)
        linear = isinstance(module, nn.Linear) and attr == "weight" and owner not in heads
        adapter = attr.endswith(ADAPTER_PARAMETERS) and param.dim() in (2, 3)
        experts = param.dim() == 3 and hasattr(getattr(module, "expert_dispatch", module), "num_experts")
        if linear or adapter or experts:
            chosen.append(name)
    return chosen


class Muon(torch.optim.Optimizer):
    """torch's Muon on the hidden matrices (`hidden_matrices`) and torch's AdamW on the other parameters, as one
    optimizer (one learning-rate schedule, one state to checkpoint); each matrix orthogonalised whole, once a step,
    whatever the layout (the module docstring says how).

    Args:
        params: The model (a module: its parameters, named, so the split is made at once), or its parameters (a
            parallelkit strategy makes the split when it sets the optimizer up; `--optimizer` on the command line).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: torch's Muon's, with
            their meaning there. `adjust_lr_fn="match_rms_adamw"` scales each matrix's update to AdamW's size
            (0.2 x sqrt(max(rows, columns))), so one learning rate suits both parts.
        adamw_lr: The AdamW part's learning rate (default: `lr`); a schedule scales both alike.
        adamw_betas, adamw_eps, adamw_weight_decay: The AdamW part's (weight decay default: `weight_decay`).
        matrices: Globs over parameter names that replace the rule for which parameters Muon takes.
    """

    def __init__(
        self,
        params: nn.Module | Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = MUON_DEFAULTS["ns_coefficients"],
        eps: float = MUON_DEFAULTS["eps"],
        ns_steps: int = MUON_DEFAULTS["ns_steps"],
        adjust_lr_fn: str | None = None,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        matrices: list[str] | None = None,
    ) -> None:
        problems = []
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            problems.append(f"adjust_lr_fn={adjust_lr_fn!r} must be 'original' or 'match_rms_adamw' (or null)")
        if not 0 < ns_steps < 100:
            problems.append(f"ns_steps={ns_steps} must be between 1 and 99 (torch's Muon: 5)")
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if value < 0:
                problems.append(f"{name}={value} must be >= 0")
        if problems:
            raise ConfigError(f"optimizer (parallelkit.Muon): {'; '.join(problems)}.")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "adamw_lr_ratio": 1.0 if adamw_lr is None or lr == 0 else adamw_lr / lr,
            "adamw_betas": tuple(adamw_betas),
            "adamw_eps": adamw_eps,
            "adamw_weight_decay": weight_decay if adamw_weight_decay is None else adamw_weight_decay,
        }
        model = params if isinstance(params, nn.Module) else None
        super().__init__([p for p in model.parameters() if p.requires_grad] if model else params, defaults)
        self.matrices = matrices
        self._muon: set[int] | None = None  # ids of Muon's parameters, once split
        self._names: dict[int, str] = {}
        self._group: Any = None  # the process group whose ranks share the matrices (a pipeline stage's)
        self._adamw: list[torch.optim.AdamW | None] = []  # per group: torch's AdamW on its other parameters
        self._layouts: dict[tuple[str, ...], _Layout] = {}  # the sharded matrices' shards and owners, once known
        if model is not None:
            self.split(model)

    def split(self, model: nn.Module, group: Any = None) -> None:
        """Decide which of the optimizer's parameters are Muon's, by their names in `model` (`hidden_matrices`);
        `group`: the process group of the ranks that share the sharded matrices (a parallelkit strategy's stage)."""
        names = {id(param): name for name, param in model.named_parameters()}
        held = [p for group_ in self.param_groups for p in group_["params"]]
        missing = [p for p in held if id(p) not in names]
        if missing:
            raise ConfigError(
                f"parallelkit.Muon was given {len(missing)} parameters {type(model).__name__} does not hold (first: "
                f"{tuple(missing[0].shape)}). Fix: build it from the model's own parameters (Muon(model, ...))."
            )
        matrices = set(hidden_matrices(model, self.matrices))
        self._names = {id(p): names[id(p)] for p in held}
        self._muon = {id(p) for p in held if names[id(p)] in matrices}
        self._group = group
        self._layouts = {}
        rest = [[p for p in group_["params"] if id(p) not in self._muon] for group_ in self.param_groups]
        self._adamw = [torch.optim.AdamW(params) if params else None for params in rest]

    def muon_parameters(self) -> list[str]:
        """The names of the parameters Muon updates (the rest AdamW), once split."""
        return [self._names[id(p)] for g in self.param_groups for p in g["params"] if id(p) in (self._muon or ())]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._muon is None:
            raise ConfigError(
                "parallelkit.Muon does not know which parameters are matrices: it was given bare parameters and no "
                "parallelkit strategy split them. Fix: Muon(self, lr=...) with the module itself in "
                "configure_optimizers (or train under a parallelkit strategy)."
            )
        for group, adamw in zip(self.param_groups, self._adamw):
            if adamw is not None:
                self._adamw_step(group, adamw)
            self._muon_step(group, [p for p in group["params"] if id(p) in self._muon and p.grad is not None])
        return loss

    def _adamw_step(self, group: dict[str, Any], adamw: torch.optim.AdamW) -> None:
        """torch's AdamW on the group's other parameters, with the group's AdamW settings as they are now (a schedule
        changes the learning rate) and its state kept in this optimizer's (per parameter: step, exp_avg,
        exp_avg_sq, as torch's AdamW keeps them; `load_state_dict` replaces that dict)."""
        adamw.state = self.state
        adamw.param_groups[0].update(
            lr=group["lr"] * group["adamw_lr_ratio"],
            betas=group["adamw_betas"],
            eps=group["adamw_eps"],
            weight_decay=group["adamw_weight_decay"],
        )
        adamw.step()

    def _muon_step(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """torch's Muon's update of `params` (`_single_tensor_muon`), each matrix orthogonalised whole."""
        if not params:
            return
        momentum, updates = group["momentum"], []
        for param in params:
            grad = local_shard(param.grad)
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            buf = local_shard(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            updates.append(grad.lerp(buf, momentum) if group["nesterov"] else buf)
        settings = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        orthogonalized = self._orthogonalize(params, updates, settings)
        lr, decay = group["lr"], group["weight_decay"]
        for param, update in zip(params, orthogonalized):
            shape = param.shape[1:] if param.dim() == 3 else param.shape
            local = local_shard(param)
            local.mul_(1 - lr * decay)
            local.add_(update, alpha=-muon_adjusted_lr(lr, group["adjust_lr_fn"], shape))

    def _orthogonalize(
        self, params: list[torch.Tensor], updates: list[torch.Tensor], settings: tuple[Any, ...]
    ) -> list[torch.Tensor]:
        """Each update orthogonalised as a whole matrix (per expert for a 3-D stack): a plain parameter's here, a
        sharded one's by its owner among the group's ranks, each rank getting its shard of the result back."""
        from torch.distributed.tensor import DTensor

        sharded = [i for i, param in enumerate(params) if isinstance(param, DTensor)]
        results: list[torch.Tensor | None] = [
            None if i in sharded else _newton_schulz(update, settings) for i, update in enumerate(updates)
        ]
        if sharded:
            chosen = [params[i] for i in sharded]
            names = tuple(self._names.get(id(p), str(i)) for i, p in enumerate(chosen))
            if names not in self._layouts:  # the same matrices every step: their shards' places found once
                self._layouts[names] = _Layout(self._group, chosen)
            for i, result in zip(
                sharded, self._layouts[names].exchange(chosen, [updates[i] for i in sharded], settings)
            ):
                results[i] = result
        return results  # type: ignore[return-value]


def _newton_schulz(update: torch.Tensor, settings: tuple[Any, ...]) -> torch.Tensor:
    """torch's Muon's orthogonalisation of a matrix (bf16 result), or of each expert's slice of a 3-D stack."""
    coefficients, steps, eps = settings
    if update.dim() == 3:
        return torch.stack([muon_orthogonalize(each, coefficients, steps, eps) for each in update.unbind(0)])
    return muon_orthogonalize(update, coefficients, steps, eps)


class _Layout:
    """Where the shards of a set of sharded matrices lie among the group's ranks, and which rank owns each matrix:
    owners are given matrices largest first, each to the rank with the fewest elements so far (every rank computes
    the same assignment). Found once (`all_gather_object` of each rank's boxes); each step's `exchange` sends each
    rank's shards of each matrix's update to its owner and the orthogonalised matrix back in shards (bf16)."""

    def __init__(self, group: Any, params: list[torch.Tensor]) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        mine = []
        for param in params:
            local, offsets = local_box(param)
            mine.append((tuple(offsets), tuple(local.shape)))
        everyone: list[Any] = [None] * self.size
        dist.all_gather_object(everyone, mine, group=group)
        # per matrix, per group rank: (offsets, shape) of its shard; and the largest shard's size (the padding)
        self.boxes = [[everyone[rank][i] for rank in range(self.size)] for i in range(len(params))]
        self.widths = [max(math.prod(shape) for _, shape in boxes) for boxes in self.boxes]
        load = [0] * self.size
        self.owners = [0] * len(params)
        for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
            self.owners[i] = min(range(self.size), key=lambda rank: (load[rank], rank))
            load[self.owners[i]] += params[i].numel()

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def exchange(
        self, params: list[torch.Tensor], updates: list[torch.Tensor], settings: tuple[Any, ...]
    ) -> list[torch.Tensor]:
        gathered, sending, works = [], [], []  # the buffers live until their collectives are waited for
        for update, width, owner in zip(updates, self.widths, self.owners):
            sent = torch.zeros(width, dtype=update.dtype, device=update.device)
            sent[: update.numel()] = update.reshape(-1)
            received = [torch.empty_like(sent) for _ in range(self.size)] if owner == self.rank else None
            works.append(dist.gather(sent, received, dst=self._global(owner), group=self.group, async_op=True))
            gathered.append(received)
            sending.append(sent)
        for work in works:
            work.wait()
        outgoing, results, works = [], [], []
        for i, (param, update) in enumerate(zip(params, updates)):
            pieces = None
            if self.owners[i] == self.rank:
                whole = torch.empty(param.shape, dtype=update.dtype, device=update.device)
                for (offsets, shape), piece in zip(self.boxes[i], gathered[i]):
                    whole[_box(offsets, shape)] = piece[: math.prod(shape)].view(shape)
                done = _newton_schulz(whole, settings)
                pieces = []
                for offsets, shape in self.boxes[i]:
                    piece = torch.zeros(self.widths[i], dtype=done.dtype, device=done.device)
                    piece[: math.prod(shape)] = done[_box(offsets, shape)].reshape(-1)
                    pieces.append(piece)
            result = torch.empty(self.widths[i], dtype=torch.bfloat16, device=update.device)
            works.append(
                dist.scatter(result, pieces, src=self._global(self.owners[i]), group=self.group, async_op=True)
            )
            outgoing.append(pieces)
            results.append(result)
        for work in works:
            work.wait()
        return [result[: update.numel()].view(update.shape) for result, update in zip(results, updates)]


def _box(offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(start, start + size) for start, size in zip(offsets, shape))
