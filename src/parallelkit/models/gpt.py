"""A GPT-style decoder, small enough to read in one sitting, written to parallelkit's model contract.

Tensor-parallel friendly: q, k and v are separate projections (a fused qkv split column-wise would hand a rank
all of q and half of k), and head counts are derived from the local projection width, never hard-coded.
Positions are rotary, applied inside attention on the full sequence, so sequence-parallel chunks of the
residual stream need no positional bookkeeping.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from parallelkit.adapters.lora import QUANTIZED_TP_REFUSAL, LoRA, add_adapters, as_lora, config_dict
from parallelkit.compat import grouped_mm, grouped_mm_runs
from parallelkit.contract import ParallelPlan, packed_examples
from parallelkit.errors import ConfigError
from parallelkit.models.lm import CausalLM


@torch.library.custom_op("parallelkit::rotary_table", mutates_args=())
def rotary_table(
    seq: int, dim: int, base: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cosines and sines of rotary embedding's angles, (seq, dim / 2).

    An operator of its own so that a compiled block computes this table once: traced inline, inductor fuses the
    angle, cosine and sine into the kernel that rotates q and k, computing them again for every batch row and head
    (measured on CPU, four blocks forward and backward: 1.06 x eager's time compiled with the table inline, 0.93-0.95
    x with this operator)."""
    inv_freq = base ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@rotary_table.register_fake
def _(seq: int, dim: int, base: float, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.empty(seq, dim // 2, device=device, dtype=dtype) for _ in range(2))


def rotary(x: torch.Tensor, positions: torch.Tensor | None = None, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of `x` shaped (batch, heads, seq, head_dim), at `positions` (batch, seq) if given
    (packed examples restart at 0), else at 0 .. seq - 1."""
    if positions is None:
        cos, sin = rotary_table(x.shape[-2], x.shape[-1], base, x.device, x.dtype)
    else:  # the table's angles, at each token's position (computed, not looked up: any position is one)
        dim = x.shape[-1]
        inv_freq = base ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
        angles = (positions.to(torch.float32).unsqueeze(-1) * inv_freq).unsqueeze(1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head  # read by the planner: tp must divide it
        self.head_dim = n_embd // n_head
        self.q = nn.Linear(n_embd, n_embd, bias=False)
        self.k = nn.Linear(n_embd, n_embd, bias=False)
        self.v = nn.Linear(n_embd, n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        batch, seq, _ = q.shape
        # -1 heads: under tensor parallelism this rank holds n_head / tp of them.
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        q, k = rotary(q, positions), rotary(k, positions)
        y = self.attend(q, k, v, positions)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Causal attention within each example (`parallelkit.contract.ATTENTION_CONTRACT`): what context parallelism
        replaces by attention across the ranks' slices of the sequence."""
        if positions is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(positions))


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed examples, (batch, 1, seq, seq), True where a query may attend: earlier or equal
    positions of its own example (`parallelkit.contract.packed_examples`)."""
    example = packed_examples(positions)
    seq = positions.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
    return ((example.unsqueeze(-1) == example.unsqueeze(-2)) & causal).unsqueeze(1)


class MLP(nn.Module):
    def __init__(self, n_embd: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Router(nn.Module):
    """Top-k routing: a softmax over the experts' logits (in fp32), each token's `top_k` largest, renormalised."""

    def __init__(self, n_embd: int, n_expert: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(n_expert, n_embd))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).float().softmax(dim=-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        return index, (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)


class Experts(nn.Module):
    """`num_experts` GELU MLPs in two 3-D weights, each token copy through its expert's: one grouped matrix multiply
    per weight over the copies sorted by expert (`parallelkit.contract.EXPERTS_CONTRACT`, which expert parallelism
    divides over the ep axis)."""

    def __init__(self, n_expert: int, n_embd: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = n_expert
        self.up = nn.Parameter(torch.empty(n_expert, hidden, n_embd))
        self.down = nn.Parameter(torch.empty(n_expert, n_embd, hidden))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        token = order // k
        h = F.gelu(grouped_linear(x.index_select(0, token), self.up, counts))
        y = grouped_linear(h, self.down, counts) * top_k_weights.reshape(-1).index_select(0, order)[:, None]
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` sorted by expert, `counts[e]` of them for expert `e`, each times its expert's `weight[e]` (E, out,
    in) transposed: torch's grouped GEMM where its kernel runs (16-byte aligned rows), else one matmul per expert."""
    if grouped_mm_runs(x, weight) or x.is_meta:  # on the meta device (the planner): shapes only
        return grouped_mm(x.contiguous(), weight.transpose(-2, -1), counts.cumsum(0).to(torch.int32))
    return torch.cat([rows @ w.T for rows, w in zip(x.split(counts.tolist()), weight)])


class MoE(nn.Module):
    """A mixture-of-experts MLP: a router picks `top_k` of `n_expert` experts per token and weights their outputs."""

    def __init__(self, n_embd: int, hidden: int, n_expert: int, top_k: int) -> None:
        super().__init__()
        self.router = Router(n_embd, n_expert, top_k)
        self.experts = Experts(n_expert, n_embd, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        index, weights = self.router(flat)
        return self.experts(flat, index, weights).view_as(x)


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, mlp_ratio: int, n_expert: int = 0, top_k: int = 2) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(n_embd)
        self.attn = Attention(n_embd, n_head)
        self.mlp_norm = nn.RMSNorm(n_embd)
        hidden = mlp_ratio * n_embd
        self.mlp = MoE(n_embd, hidden, n_expert, top_k) if n_expert else MLP(n_embd, hidden)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class GPT(CausalLM):
    """Decoder-only transformer language model (byte-level by default) that parallelkit parallelises.

    Args:
        vocab_size: Number of token ids (256 for the byte-level datamodules).
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block; tensor parallelism needs tp to divide it.
        n_embd: Width of the residual stream; a multiple of n_head.
        mlp_ratio: MLP hidden width as a multiple of n_embd.
        lr: Peak AdamW learning rate, reached after the warmup.
        weight_decay: AdamW weight decay, applied to matrices and embeddings only (not norms).
        betas: AdamW betas.
        warmup_steps: Optimizer steps of linear warmup from 0 to `lr`.
        min_lr_ratio: The cosine decay reaches `lr * min_lr_ratio` as the run ends (after its last step).
        init_std: Standard deviation of the normal initialisation of weights.
        lora: Low-rank adapters (`parallelkit.adapters.lora.LoRA`: rank, alpha, dropout, targets) on the targeted linear
            layers, every other parameter frozen. None: the whole model trains.
        n_expert: Experts per block's MLP, a mixture of experts (0: a dense MLP). Expert parallelism (an `ep` mesh
            axis) divides them; ep must divide n_expert.
        top_k: Experts each token is routed to, when n_expert > 0.
    """

    # The parallel contract (README, "The model contract"): globs over module names -> how each is split.
    tp_plan = {
        "tok_emb": "vocab_embedding",
        "blocks.*.attn_norm": "sequence_parallel",
        "blocks.*.attn": "gather_input",  # one all-gather of the sequence-sharded input for q, k and v
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp_norm": "sequence_parallel",
        "blocks.*.mlp": "gather_input",
        "blocks.*.mlp.up": "colwise",
        "blocks.*.mlp.down": "rowwise",
        "norm": "sequence_parallel",
        "head": "vocab_head",
    }
    fsdp_units = ["blocks.*"]
    pipeline_layers = ["tok_emb", "blocks.*", "norm", "head"]
    attention_plan = ["blocks.*.attn"]

    def __init__(
        self,
        vocab_size: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        mlp_ratio: int = 4,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        init_std: float = 0.02,
        lora: LoRA | None = None,
        n_expert: int = 0,
        top_k: int = 2,
    ) -> None:
        super().__init__()
        if n_expert and not 1 <= top_k <= n_expert:
            raise ConfigError(
                f"GPT top_k={top_k} with n_expert={n_expert}: each token is routed to top_k of the n_expert experts. "
                f"Fix: a top_k from 1 to {n_expert} (2 is usual)."
            )
        if n_head < 1 or n_embd % n_head:
            raise ConfigError(
                f"GPT n_embd={n_embd} is not a multiple of n_head={n_head}: each attention head takes n_embd / n_head "
                f"channels. Fix: set model.init_args.n_head to a divisor of {n_embd}, or n_embd to a multiple of it."
            )
        lora = config_dict(as_lora(lora))  # plain values in the hyperparameters (and checkpoints)
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, mlp_ratio, n_expert, top_k) for _ in range(n_layer))
        if n_expert:  # the mixture runs whole on every tp rank (nothing in it is split); ep divides its experts
            mlp = {"blocks.*.mlp": "gather_sequence"}
            dense = {k: v for k, v in self.tp_plan.items() if not k.startswith("blocks.*.mlp.")}
            self.tp_plan = {**dense, **mlp}
            self.experts_plan = ["blocks.*.mlp.experts"]
        self.norm = nn.RMSNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.init_weights()
        add_adapters(self, lora)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter; strategies call it after materialising a meta-device model."""
        std = self.hparams.init_std
        # Residual projections scaled down so the stream's variance does not grow with depth (GPT-2).
        residual_std = std / math.sqrt(2 * self.hparams.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                out = name.endswith(("attn.proj", "mlp.down"))
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if out else std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, Router):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, Experts):
                nn.init.normal_(module.up, mean=0.0, std=std)
                nn.init.normal_(module.down, mean=0.0, std=residual_std)

    @property
    def vocab_size(self) -> int:
        """Token ids the model embeds: `0 .. vocab_size - 1`."""
        return self.hparams.vocab_size

    @override
    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of `idx` (batch, seq); `positions` (batch, seq) for packed examples (each attends to itself only)."""
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, positions)
        return self.head(self.norm(x))

    def parallel_plan(self) -> ParallelPlan:
        """The class attributes' plan, with a pipeline stage forward that hands packed examples' positions on."""
        plan = replace(ParallelPlan.from_attributes(self), stage_forward=self.run_stage)
        quantized = (self.hparams.get("lora") or {}).get("quantize_base")
        return replace(plan, tp_refusal=QUANTIZED_TP_REFUSAL) if quantized else plan

    def run_stage(self, layers: list[tuple[str, nn.Module]], x: torch.Tensor, *positions: torch.Tensor) -> Any:
        """One pipeline stage: token ids or hidden states in, and, for packed examples, their positions, which the
        blocks read and the stage hands on with its output (the last stage returns logits alone)."""
        for name, layer in layers:
            x = layer(x, *positions) if name.startswith("blocks.") else layer(x)
        return (x, *positions) if positions and layers[-1][0] != "head" else x

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token of the layers this module holds (all of them unless a
        pipeline stage dropped some): 6 per weight of every matrix multiply (the embedding lookup is none), plus
        12 x width x sequence length per block for attention scores and values (PaLM's accounting)."""
        matmul = sum(p.numel() for name, p in self.named_parameters() if p.ndim == 2 and not name.startswith("tok_"))
        # A token goes through top_k of each block's experts.
        experts = sum(p.numel() for p in self.parameters() if p.ndim == 3) * self.hparams.top_k
        matmul += experts / max(self.hparams.n_expert, 1)
        blocks = sum(block is not None for block in self.blocks)
        return 6.0 * matmul + 12.0 * blocks * self.hparams.n_embd * seq_len
