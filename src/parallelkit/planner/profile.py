"""Counting a model for the planner: one meta forward of one sample, the saved-tensor ledger attributing what autograd
keeps to each pipeline layer, and the tp plan's sharded and gathered parameters."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from parallelkit.adapters.experts import unquantized_experts
from parallelkit.adapters.lora import WHOLE_UNDER, LoRALinear, wants_nf4
from parallelkit.adapters.nf4 import expert_nf4_bytes
from parallelkit.compat import flash_attention_on_cpu
from parallelkit.contract import GATHERING_STYLES, SHARDING_STYLES
from parallelkit.errors import PlanError
from parallelkit.memory import SavedTensorLedger, nbytes, nf4_bytes
from parallelkit.models.preference import reference_source
from parallelkit.optimizers.muon import hidden_matrices
from parallelkit.parallel.resolve import expand_tp, gathered_inside, resolve
from parallelkit.planner.records import Layer, ModelProfile

_GROUPED_MM = (getattr(torch.nn.functional, "grouped_mm", None), getattr(torch, "_grouped_mm", None))


class _MetaForward(torch.overrides.TorchFunctionMode):
    """What a meta forward needs to count what a real one keeps.

    Meta tensors pick SDPA's math path, which keeps the T x T attention matrix; real runs use a flash kernel that
    keeps q, k, v, the output and the log-sum-exp: attention is run as that kernel (grouped-query key/value heads
    repeated, as the kernel takes them). An experts module's grouped GEMM, whose meta kernel takes bf16 only, runs as
    one matrix multiply of the same shapes, and its count of tokens per expert (a value) is zeros. And a meta tensor
    has no value to branch on: model code that asks one for a truth value (transformers checks whether positions
    restart, i.e. sequences are packed) is told "true", the unpacked, unpadded case of a training batch of full
    windows."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__bool__ and args[0].is_meta:
            return True
        if func is torch.bincount and args[0].is_meta:  # counts of routed tokens: their sizes, not their values
            return torch.zeros(max(kwargs.get("minlength", 0), 1), dtype=torch.int64, device="meta")
        if func in _GROUPED_MM and args[0].is_meta:
            # Experts' grouped GEMM, whose meta kernel takes bf16 only: the same output shape and saved input.
            return torch.matmul(args[0], args[1][0])
        if func is torch.nn.functional.scaled_dot_product_attention and kwargs.get("attn_mask") is None:
            q, k, v = args[:3]
            if k.shape[-3] != q.shape[-3]:  # grouped-query attention
                k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
            return flash_attention_on_cpu(q, k, v, bool(kwargs.get("is_causal", False)), kwargs.get("scale"))
        return func(*args, **kwargs)


def profile(
    model: nn.Module, seq_len: int, tp_degrees: Iterable[int] = (1,), vocab_size: int | None = None
) -> ModelProfile:
    """Count `model` (on the meta device) per pipeline layer, running one meta forward of one sample."""

    resolved = resolve(model)
    plan = resolved.plan
    names = list(resolved.pipeline_layers)  # none when not pipelinable (e.g. tied embeddings): no pipeline layout
    units = set(resolved.fsdp_units)
    experts = [model.get_submodule(name) for name in resolved.experts]
    muon = {id(model.get_parameter(name)) for name in hidden_matrices(model)}
    expert_params = {id(p) for module in experts for p in module.parameters()}
    sharded: set[int] = set()
    tp_modules: list[tuple[nn.Module, str]] = []
    styles = expand_tp(model, plan) if plan.tp else {}
    gathering = gathered_inside(styles)
    for fqn, style in styles.items():
        module = model.get_submodule(fqn)
        if style in SHARDING_STYLES:
            whole = WHOLE_UNDER.get(style) if isinstance(module, LoRALinear) else None
            sharded.update(id(p) for name, p in module.named_parameters() if name != whole)
        if (style in SHARDING_STYLES or style in GATHERING_STYLES) and fqn not in gathering:
            tp_modules.append((module, style))

    ledger = SavedTensorLedger()
    marks: dict[str, list[float]] = {}
    gathered: dict[int, float] = {}
    scattered: dict[int, float] = {}
    routed: dict[int, float] = {}
    outputs: dict[str, float] = {}
    handles = []

    def enter(name: str) -> Any:
        return lambda module, args: marks.__setitem__(name, [ledger.live])

    def leave(name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            marks[name].append(ledger.live)
            outputs[name] = nbytes(output)

        return hook

    def record(into: dict[int, float], what: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any = None) -> None:
            into[id(module)] = nbytes(args if what == "input" else output)

        return hook

    for name in names:
        layer = model.get_submodule(name)
        handles += [layer.register_forward_pre_hook(enter(name)), layer.register_forward_hook(leave(name))]

    def copies(module: nn.Module, args: Any) -> None:  # (tokens [N, H], top_k_index [N, k], ...)
        tokens, index = args[0], args[1]
        routed[id(module)] = float(tokens.shape[0] * index.shape[-1] * tokens.shape[-1] * 4)

    handles += [module.register_forward_pre_hook(copies) for module in experts]
    attended: dict[int, tuple[float, float]] = {}  # attention module -> (queries, keys and values) bytes
    head_counts: dict[int, tuple[int, int]] = {}  # attention module -> (query, key/value) heads

    def recording(module: nn.Module) -> Any:
        attend = module.attend

        def record_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            attended[id(module)] = (nbytes(q), nbytes(k) + nbytes(v))
            head_counts[id(module)] = (q.shape[1], k.shape[1])
            return attend(q, k, v, *args, **kwargs)

        return record_attend

    def projected(module: nn.Module, args: Any, kwargs: dict) -> None:
        # A module whose model routes its attention (transformers' through their attention interface): q, k and v
        # are its input projected to heads x head_dim, as the config counts them.
        hidden, config = kwargs.get("hidden_states", args[0] if args else None), module.config
        heads = config.num_attention_heads
        per_head = nbytes(hidden) / hidden.shape[-1] * getattr(module, "head_dim", config.hidden_size // heads)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        attended[id(module)] = (per_head * heads, 2 * per_head * kv_heads)
        head_counts[id(module)] = (heads, kv_heads)

    attention = [model.get_submodule(name) for name in resolved.attention]
    own = [module.__dict__.get("attend") for module in attention]  # an attend set on the instance, if any
    for module in attention:
        if callable(getattr(module, "attend", None)):
            module.attend = recording(module)
        else:
            handles.append(module.register_forward_pre_hook(projected, with_kwargs=True))
    for module, style in tp_modules:
        # Sequence parallelism all-gathers a column-wise layer's input (which autograd then keeps whole), once for
        # all of them in a gather_input module, and reduce-scatters a row-wise layer's output.
        if style in GATHERING_STYLES:
            handles.append(module.register_forward_pre_hook(record(gathered, "input")))
        else:
            handles.append(module.register_forward_hook(record(scattered, "output")))
    embeddings = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab = vocab_size or (embeddings[0] if embeddings else 2)
    tokens = torch.randint(0, vocab, (1, seq_len), device="meta")
    try:
        with torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack), _MetaForward():
            output = model(tokens)
            before_loss = ledger.live
            if plan.loss is not None:
                plan.loss(output, tokens)
    finally:
        for handle in handles:
            handle.remove()
        for module, attend in zip(attention, own):
            if attend is None and "attend" in module.__dict__:
                del module.attend  # the class's method again
            else:
                module.attend = attend
    loss_activations = ledger.live - before_loss

    layers = []
    for name in names or [""]:
        module = model.get_submodule(name) if name else model
        members = {id(m) for m in module.modules()}
        params = list(module.parameters())
        start, end = marks.get(name, [0.0, before_loss])[:2] if name else (0.0, before_loss)
        waiting = [weight for _, weight in unquantized_experts(module)]  # NF4 experts, as a meta build leaves them
        nf4_experts = (
            [w.numel() for w in waiting],
            [len(w) * expert_nf4_bytes(w[0].numel(), w.dtype) for w in waiting],
        )
        layers.append(
            Layer(
                name=name or type(model).__name__,
                params=sum(p.numel() for p in params),
                tp_sharded=sum(p.numel() for p in params if id(p) in sharded),
                activations=end - start,
                gathered_inputs=sum(v for k, v in gathered.items() if k in members),
                tp_traffic=sum(v for k, v in (*gathered.items(), *scattered.items()) if k in members),
                output=outputs.get(name, 0.0),
                unit=name in units,
                trainable=sum(p.numel() for p in params if p.requires_grad),
                tp_trainable=sum(p.numel() for p in params if p.requires_grad and id(p) in sharded),
                experts=sum(p.numel() for p in params if id(p) in expert_params),
                trainable_experts=sum(p.numel() for p in params if p.requires_grad and id(p) in expert_params),
                matrices=sum(p.numel() for p in params if id(p) in muon),
                routed=sum(v for k, v in routed.items() if k in members),
                quantized=sum(m.weight.numel() for m in module.modules() if wants_nf4(m)) + sum(nf4_experts[0]),
                quantized_bytes=sum(nf4_bytes(m.weight.numel()) for m in module.modules() if wants_nf4(m))
                + sum(nf4_experts[1]),
                quantized_experts=sum(nf4_experts[0]),
                quantized_experts_bytes=sum(nf4_experts[1]),
                attention_q=sum(q for key, (q, _) in attended.items() if key in members),
                attention_kv=sum(kv for key, (_, kv) in attended.items() if key in members),
            )
        )
    valid: dict[int, str] = {}
    for tp in tp_degrees:
        try:
            if tp > 1:
                resolve(model, tp=tp, plan=plan)
            valid[tp] = ""
        except PlanError as err:
            valid[tp] = str(err)
    flops = plan.flops_per_token
    flops_per_token = flops(seq_len) if flops is not None else 6.0 * sum(layer.params for layer in layers)
    fewest = min((module.num_experts for module in experts), default=0)
    counts = head_counts.values()
    fewest_heads = (min(q for q, _ in counts), min(kv for _, kv in counts)) if head_counts else None
    return ModelProfile(
        plan.description,
        layers,
        loss_activations,
        flops_per_token,
        valid,
        fewest,
        fewest_heads,
        reference_source(model) if getattr(model, "preference", None) is not None else None,
    )
