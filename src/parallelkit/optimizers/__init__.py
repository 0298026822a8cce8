"""Optimizers and what runs around their step under any layout.

Rooms:
- `muon`: `Muon` (torch's Muon on the hidden matrices, whole across shards, AdamW on the rest) and `hidden_matrices`,
  the rule that picks them;
- `compiled`: the optimizer's update compiled (`compile_step`; AdamW, Adam and SGD traced over their DTensors' local
  shards, `LocalShards`), and plain tensors replicated beside DTensors for a foreach update;
- `grad_norm`: the gradient's norm over every shard and stage (`global_grad_norm`, `clip_grad_norm_`), and the
  gradients of tensor-parallel parameters settled without FSDP.

The old paths (`parallelkit.muon`, `parallelkit.optim`, `parallelkit.grad_norm`) are these modules; `parallelkit.Muon`
is `Muon`. The names below are handed on when first used, so importing one room loads no other.
"""

from parallelkit.lazy import handed_on

_NAMES = {
    "Muon": "muon",
    "hidden_matrices": "muon",
    "compile_step": "compiled",
    "global_grad_norm": "grad_norm",
    "clip_grad_norm_": "grad_norm",
}

__getattr__ = handed_on(__name__, _NAMES)
__all__ = sorted(_NAMES)
