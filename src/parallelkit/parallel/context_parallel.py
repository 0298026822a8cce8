"""Context parallelism: every sequence split over the ranks of a `cp` group, attention computed across the split.

**The split.** A sequence of T tokens is cut into 2 x cp chunks of equal length, and cp rank i holds chunks i and
2cp-1-i, in that order (`SequenceSplit`). Under a causal mask a query attends to the keys before it, so an early chunk
costs little and a late one much; pairing the i-th with the i-th from the end gives every rank the same work, as
torchtitan, Megatron and Llama 3's training do. Positions (rotary tables, document boundaries) are the whole
sequence's: a rank's tokens keep their global indices.

**Two ways to attend across the split**, both plain `torch.distributed` collectives with autograd (gloo and nccl
alike), both exact (the same scores and softmax as one process, only another summation order):

- `allgather_attention`: each rank gathers every rank's keys and values (an all-gather of K and V; in backward their
  gradients are summed back to the ranks that own them) and attends each of its chunks of queries against the keys up
  to the chunk's last one, with the causal and document mask of their global indices. Any head count, grouped-query
  attention included; K and V of the whole sequence are held for the call (Llama 3's training and torchtitan's
  `allgather` rotation do this).
- `ulysses_attention` (DeepSpeed Ulysses): an all-to-all turns sequence-sharded q, k, v of every head into the whole
  sequence of H / cp heads; each rank attends those heads over the whole sequence, and a second all-to-all turns the
  output back. Four all-to-alls of the activations' size per layer, independent of cp; needs the (query and key/value)
  head counts divisible by cp.

The masks are built from the whole sequence's positions, gathered once per call: a packed row's documents (positions
restart at 0 where an example begins) are kept apart across the split exactly as on one process. Both take what
transformers' attention modules pass besides (a scale, a sliding window, a score softcap: `models/hf_attention.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache, partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from parallelkit.contract import ATTENTION_HOOK, packed_examples, split_pair
from parallelkit.errors import PlanError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

METHODS = ("allgather", "ulysses")
"""The attention methods a strategy's `cp_method` may name."""


@dataclass(frozen=True)
class SequenceSplit:
    """Which tokens of a sequence cp rank `rank` of `cp` holds: chunks `rank` and `2 cp - 1 - rank` of 2 x cp."""

    cp: int
    rank: int

    def check(self, seq_len: int, what: str = "data.seq_len") -> None:
        """Refuse a sequence the split cannot cut into 2 x cp equal chunks, naming the numbers and a fix."""
        chunks = 2 * self.cp
        if seq_len % chunks:
            fits = seq_len - seq_len % chunks
            raise PlanError(
                f"{what}={seq_len} is not divisible by 2 x cp = {chunks}: context parallelism cuts each sequence into "
                f"2 x cp chunks of equal length (rank i holds chunks i and {chunks - 1}-i, so causal work is "
                f"balanced). Fix: {what}={fits or chunks}, or a cp size that divides {seq_len} / 2."
            )

    def indices(self, seq_len: int, rank: int | None = None) -> torch.Tensor:
        """Global indices of `rank`'s tokens (default: this split's), in the order it holds them; made once per
        length, not at every layer of every step."""
        return _indices(self.cp, self.rank if rank is None else rank, seq_len)

    def _make_indices(self, seq_len: int, rank: int) -> torch.Tensor:
        self.check(seq_len)
        chunk = seq_len // (2 * self.cp)
        first, second = rank * chunk, (2 * self.cp - 1 - rank) * chunk
        return torch.cat((torch.arange(first, first + chunk), torch.arange(second, second + chunk)))

    def gathered(self, seq_len: int) -> torch.Tensor:
        """Global indices of the tokens of every rank laid end to end in rank order (what an all-gather gives); made
        once per length."""
        return _gathered(self.cp, seq_len)

    def order(self, seq_len: int) -> torch.Tensor:
        """The permutation that puts gathered tokens (`gathered`) back into sequence order: `gathered[order]` is
        `arange(seq_len)`; made once per length."""
        return _order(self.cp, seq_len)

    def take(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `tensor`, whose dimension `dim` is the whole sequence."""
        index = self.indices(tensor.shape[dim]).to(tensor.device)
        return tensor.index_select(dim, index)


class _Gather(torch.autograd.Function):
    """All-gather along `dim` whose backward sums every rank's gradient of each part on the part's owner.

    (torch's own differentiable all-gather emulates that sum on gloo with an all-to-all that addresses ranks of the
    whole world, not of the group, so it fails on a cp group that is not the world.)"""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: object, dim: int) -> torch.Tensor:
        import torch.distributed as dist

        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        import torch.distributed as dist

        parts = torch.stack(grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)).contiguous()
        received = torch.empty_like(parts)  # [r]: rank r's gradient of this rank's part
        dist.all_to_all_single(received, parts, group=ctx.group)
        return received.sum(0), None, None


@cache
def _indices(cp: int, rank: int, seq_len: int) -> torch.Tensor:
    return SequenceSplit(cp, rank)._make_indices(seq_len, rank)


@cache
def _gathered(cp: int, seq_len: int) -> torch.Tensor:
    return torch.cat([_indices(cp, rank, seq_len) for rank in range(cp)])


@cache
def _order(cp: int, seq_len: int) -> torch.Tensor:
    return torch.argsort(_gathered(cp, seq_len))


def _gather(tensor: torch.Tensor, group: object | None, split: SequenceSplit, dim: int) -> torch.Tensor:
    """Every rank's `tensor` (this rank's tokens along `dim`) as the whole sequence in order; differentiable. With
    `group` None this process holds every rank's tokens already, laid end to end in rank order."""
    whole = tensor if group is None else _Gather.apply(tensor, group, dim)
    return whole.index_select(dim, split.order(whole.shape[dim]).to(whole.device))


@dataclass
class _Rows:
    """What the masks need of one forward's rows, from the whole sequence's positions: each token's example (batch,
    seq) and, asked once, whether every row is one example. Every attention layer of a forward gets the same
    positions tensor, so this is made for the first and kept for the others (`_rows`): the positions' all-gather is
    a collective and the check a device sync, once per forward rather than once per layer."""

    positions: torch.Tensor | None
    group: object | None
    split: SequenceSplit
    examples: torch.Tensor
    _one_each: bool | None = None

    def one_example_each(self) -> bool:
        if self._one_each is None:
            self._one_each = bool((self.examples == self.examples[:, :1]).all())
        return self._one_each


_last_rows: list[_Rows] = []


def _rows(
    positions: torch.Tensor | None, group: object | None, split: SequenceSplit, local: int, like: torch.Tensor
) -> _Rows:
    """The `_Rows` of `positions` (this rank's tokens' global positions, (batch, local); None for an unpacked row:
    the token indices), reused while the same tensor comes back."""
    if positions is None:
        seq = local if group is None else local * split.cp
        examples = torch.zeros(like.shape[0], seq, dtype=torch.long, device=like.device)
        return _Rows(None, group, split, examples, _one_each=True)
    if _last_rows and (last := _last_rows[0]).positions is positions and (last.group, last.split) == (group, split):
        return last
    with torch.no_grad():
        examples = packed_examples(_gather(positions, group, split, dim=1))
    _last_rows[:] = [_Rows(positions, group, split, examples)]
    return _last_rows[0]


def _mask(query_index: torch.Tensor, documents: torch.Tensor, window: int | None) -> torch.Tensor:
    """(batch, 1, queries, seq), True where the query at global index `query_index[i]` sees a key: an earlier (or
    the same) token of its own example (`documents`: each token's, (batch, seq)), and with `window`, one fewer than
    `window` tokens back (transformers' sliding window)."""
    back = query_index.unsqueeze(-1) - torch.arange(documents.shape[1], device=documents.device)
    visible = (back >= 0) & (back < window) if window is not None else back >= 0
    same = documents.index_select(1, query_index).unsqueeze(-1) == documents.unsqueeze(-2)
    return (visible & same).unsqueeze(1)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """Attention under `mask` (None: causal); `scale` None is 1 / sqrt(head_dim). With `softcap`, the scores are
    capped to softcap x tanh(scores / softcap) before the softmax (Gemma 2's), as transformers' eager attention does:
    SDPA has no such argument, so the scores are made here."""
    if softcap is None:
        gqa = k.shape[1] != q.shape[1]
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )
    groups = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    at_least_fp32 = torch.promote_types(scores.dtype, torch.float32)  # the softmax of bf16 scores in fp32
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=at_least_fp32)
    return torch.matmul(weights.to(q.dtype), values)


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor | None,
    group: object | None,
    split: SequenceSplit,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries against the whole sequence's keys and values.

    `q`: (batch, heads, local, dim), `k`/`v`: (batch, kv_heads, local, dim), this rank's tokens in `split`'s order;
    `positions`: their global positions (batch, local), or None for an unpacked causal row. Returns (batch, heads,
    local, dim), what one process's causal (document-masked) attention gives at these queries. `scale` (None: 1 /
    sqrt(dim)), a sliding `window` and a score `softcap` as transformers' attention functions take them.

    `group` None: one process holds every rank's tokens, laid end to end in rank order (`SequenceSplit.gathered`),
    and attends them all as the ranks would: how the family sweep checks a model's attention without processes."""
    local = q.shape[2]
    keys, values = _gather(k, group, split, dim=2), _gather(v, group, split, dim=2)
    documents = _rows(positions, group, split, local, q).examples
    seq = documents.shape[1]
    held = split.gathered(seq) if group is None else split.indices(seq)
    chunk = seq // (2 * split.cp)
    out = []
    for start in range(0, local, chunk):  # a chunk's queries attend only the keys up to its last one: about half of
        end = int(held[start + chunk - 1]) + 1  # the (local x seq) scores a single call would make and mask
        mask = _mask(held[start : start + chunk].to(q.device), documents[:, :end], window)
        out.append(_attend(q[:, :, start : start + chunk], keys[:, :, :end], values[:, :, :end], mask, scale, softcap))
    return torch.cat(out, dim=2)


def _sequence_for_heads(tensor: torch.Tensor, group: object, split: SequenceSplit) -> torch.Tensor:
    """(batch, heads, local, dim) of this rank's tokens -> (batch, heads / cp, seq, dim): the whole sequence of this
    rank's share of the heads, by one all-to-all."""
    from torch.distributed.nn.functional import all_to_all_single

    batch, heads, local, dim = tensor.shape
    cp = split.cp
    out = tensor.reshape(batch, cp, heads // cp, local, dim).transpose(0, 1).contiguous()
    received = all_to_all_single(torch.empty_like(out), out, group=group)  # [r]: rank r's tokens, my heads
    whole = received.permute(1, 2, 0, 3, 4).reshape(batch, heads // cp, cp * local, dim)
    return whole.index_select(2, split.order(cp * local).to(tensor.device))


def _heads_for_sequence(tensor: torch.Tensor, group: object, split: SequenceSplit) -> torch.Tensor:
    """The inverse of `_sequence_for_heads`: (batch, heads / cp, seq, dim) -> (batch, heads, local, dim)."""
    from torch.distributed.nn.functional import all_to_all_single

    batch, shared, seq, dim = tensor.shape
    cp = split.cp
    by_rank = tensor.index_select(2, split.gathered(seq).to(tensor.device))  # rank r's tokens at [r * local, ...)
    out = by_rank.reshape(batch, shared, cp, seq // cp, dim).permute(2, 0, 1, 3, 4).contiguous()
    received = all_to_all_single(torch.empty_like(out), out, group=group)  # [j]: my tokens, head group j
    return received.transpose(0, 1).reshape(batch, cp * shared, seq // cp, dim)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor | None,
    group: object,
    split: SequenceSplit,
    *,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention by heads: all-to-all to the whole sequence of heads / cp heads, attention as on one process,
    all-to-all back. Arguments as `allgather_attention`'s; every head count divisible by cp (`check_heads`)."""
    local = q.shape[2]
    check_heads(q.shape[1], k.shape[1], split.cp)
    rows = _rows(positions, group, split, local, q)
    queries, keys, values = (_sequence_for_heads(t, group, split) for t in (q, k, v))
    mask = None  # one example per row and no window: the kernel's own causal mask, no seq x seq tensor
    if window is not None or not rows.one_example_each():
        seq = rows.examples.shape[1]
        mask = _mask(torch.arange(seq, device=q.device), rows.examples, window)
    return _heads_for_sequence(_attend(queries, keys, values, mask, scale, softcap), group, split)


def check_heads(heads: int, kv_heads: int, cp: int) -> None:
    """Refuse Ulysses for head counts cp does not divide, naming them and the fix."""
    if heads % cp or kv_heads % cp:
        raise PlanError(
            f"cp_method='ulysses' needs the attention's heads divisible by cp: each tp rank holds {heads} query and "
            f"{kv_heads} key/value heads, cp={cp}. Fix: cp_method=allgather (any head count), "
            f"or a cp size that divides {heads} and {kv_heads}."
        )


ATTENTION = {"allgather": allgather_attention, "ulysses": ulysses_attention}
"""Each method's attention function: (q, k, v, positions, group, split, *, scale, window, softcap) -> output."""


def apply_context_parallel(
    root: nn.Module, cp_mesh: DeviceMesh, attention: Sequence[str], method: str, model: nn.Module | None = None
) -> None:
    """Make the attention modules of `root` named in `attention` (the resolved plan's) attend across the cp ranks'
    slices: each one's `attend` becomes `method`'s, over `cp_mesh`'s group, for this rank's `SequenceSplit`. `model`:
    what `root` was made from (a pipeline stage's model), told to route its attention (default: `root`)."""
    split = SequenceSplit(cp_mesh.size(), cp_mesh.get_local_rank())
    attend = partial(ATTENTION[method], group=cp_mesh.get_group(), split=split)
    # Compiled blocks run it eagerly between their compiled parts: its collectives and their custom backward are
    # not for dynamo to trace (a graph break at each attention, the projections and MLP around it compiled).
    route_attention(root, attention, torch.compiler.disable(attend), model)


def route_attention(root: nn.Module, attention: Sequence[str], attend: Any, model: nn.Module | None = None) -> None:
    """Give each module of `root` named in `attention` the attention function `attend`, and tell a model that routes
    its attention (`parallelkit.contract.ATTENTION_HOOK`: `HFCausalLM`), `model` or one inside it (default: `root`),
    to call it."""
    held = dict(root.named_modules())
    for fqn in attention:
        if fqn in held:
            held[fqn].attend = attend
    for module in (root if model is None else model).modules():
        route = getattr(module, ATTENTION_HOOK, None)
        if callable(route):
            route()


SLICED = ("input_ids", "labels", "position_ids")
"""The keys of a token batch that hold a value per token: each cp rank keeps its slice of them."""


def split_batch(batch: Any, split: SequenceSplit, replicas: int) -> dict[str, Any]:
    """This rank's slice of every sequence of `batch`, as a token batch (`parallelkit.contract.TOKEN_BATCH`).

    A token batch keeps its `num_targets` (the step's count, whatever each rank holds). An `(inputs, targets)` batch
    becomes one: its positions are the sequence's token indices, and every position is a target, so the step's
    count is this batch's times `replicas` (the step's batches: data-parallel ranks x accumulated micro-batches).
    The loss is then the step's token mean on every layout, as one process's mean over the whole batch."""
    if isinstance(batch, Mapping):
        return {key: split.take(value) if key in SLICED else value for key, value in batch.items()}
    inputs, targets = split_pair(batch)
    positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    sliced = {"input_ids": split.take(inputs), "position_ids": split.take(positions)}
    if targets is not None:
        sliced["labels"] = split.take(targets)
        sliced["num_targets"] = torch.tensor(targets.numel() * replicas, device=inputs.device)
    return sliced
