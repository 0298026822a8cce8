"""Both context-parallel attention methods against one process's attention, on 4 ranks (cp = 2 as two groups, and
cp = 4): outputs and the gradients of q, k and v, for unpacked rows and for packed rows whose documents cross the
chunk boundaries, with grouped-query attention where the method takes it; and, on packed rows, with what
transformers' attention modules pass besides (a scale, a sliding window, a score softcap), against the eager
attention written out here. Exits non-zero on any difference; rank 0 prints each case checked."""

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallelkit.models.gpt import document_mask
from parallelkit.parallel.context_parallel import ATTENTION, SequenceSplit

OPTIONS = {"": {}, " windowed": {"scale": 0.3, "window": 5}, " capped": {"softcap": 2.0, "window": 5}}


def one_process(q, k, v, positions, scale=None, window=None, softcap=None):  # noqa: ANN001, ANN201
    """Attention on the whole sequence: SDPA without options, else the scores written out (as eager attention)."""
    gqa = k.shape[1] != q.shape[1]
    mask = None if positions is None else document_mask(positions)
    if not (scale or window or softcap):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
    index = torch.arange(q.shape[2])
    mask = mask & (index.unsqueeze(-1) - index < window)
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
groups = {2: [dist.new_group([r, r + 1]) for r in range(0, world, 2)], 4: [dist.new_group(list(range(world)))]}
batch, heads, seq, dim = 2, 4, 16, 8
packed = torch.tensor([[*range(6), *range(10)], [*range(3), *range(13)]])  # documents crossing the chunks' edges
checked = []
for cp, cp_groups in groups.items():
    group, split = cp_groups[rank // cp], SequenceSplit(cp, rank % cp)
    for method, attend in ATTENTION.items():
        for kv_heads in (heads, 2):
            if method == "ulysses" and kv_heads % cp:
                continue  # refused by name: test_context_parallel.py
            for positions, options in [(None, ""), (packed, ""), *((packed, name) for name in OPTIONS if name)]:
                generator = torch.Generator().manual_seed(cp * 100 + kv_heads * 10 + (positions is None))
                q = torch.randn(batch, heads, seq, dim, generator=generator, dtype=torch.float64)
                k, v = (torch.randn(batch, kv_heads, seq, dim, generator=generator, dtype=torch.float64) for _ in "kv")
                grad = torch.randn(batch, heads, seq, dim, generator=generator, dtype=torch.float64)
                whole = [t.clone().requires_grad_() for t in (q, k, v)]
                expected = one_process(*whole, positions, **OPTIONS[options])
                expected.backward(grad)
                local = [split.take(t, dim=2).clone().requires_grad_() for t in (q, k, v)]
                mine = None if positions is None else split.take(positions, dim=1)
                out = attend(*local, mine, group, split, **OPTIONS[options])
                out.backward(split.take(grad, dim=2))
                case = f"{method} cp={cp} kv_heads={kv_heads} {'unpacked' if positions is None else 'packed'}{options}"
                torch.testing.assert_close(out, split.take(expected, dim=2), rtol=1e-9, atol=1e-9, msg=case)
                for name, ours, theirs in zip("qkv", local, whole):
                    torch.testing.assert_close(
                        ours.grad, split.take(theirs.grad, dim=2), rtol=1e-9, atol=1e-9, msg=f"{case}: d{name}"
                    )
                checked.append(case)
if rank == 0:
    print(json.dumps(checked))
dist.destroy_process_group()
