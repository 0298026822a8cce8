"""4-bit NormalFloat (NF4) base weights for QLoRA, through torchao's `NF4Tensor`.

A frozen weight stored as NF4 holds, per 64 values (a block), 4-bit codes and an 8-bit scale, and per group of
blocks (a scaler block) one more scale: about 0.5 byte per parameter plus scalers, against 4 in fp32. torchao
implements `F.linear` on it (dequantizing on the fly, forward and backward) and FSDP2's all-gather hooks, so a
sharded NF4 weight travels as 4-bit data.

A weight is quantized as torchao's `to_nf4(weight, 64, 256)`: the block and scaler-block sizes torchao and
bitsandbytes default to, so the base is the standard QLoRA model in every layout. FSDP2 cuts each quantized tensor
into equal parts by rows, which 256-block scaler blocks rarely allow (each of Qwen2.5-0.5B's 896 x 896 projections
has 49), so the stored scaler blocks are split: each one's factor repeated over sub-blocks (128, 64, ... blocks)
until their count is a multiple of `SHARDS`. Every quantized value (codes, per-block scales, scaler factors, mean)
stays torchao's. A weight whose count of blocks 256 does not divide (tiny models) is quantized with the largest
scaler block that does. torchao is the optional extra `[qlora]`, imported only when a model asks for NF4.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from parallelkit.errors import ConfigError

BLOCK = 64
"""Values per NF4 block (torchao's default)."""

SCALER_BLOCK = 256
"""Blocks per scaler block at most (torchao's default)."""

SHARDS = 8
"""The number of stored scaler blocks of every NF4 weight is a multiple of this (when the weight allows), so FSDP can
cut it into 2, 4 or 8 equal parts."""


def _nf4_module() -> Any:
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as err:
        raise ConfigError(
            "lora.quantize_base: nf4 needs torchao (NF4Tensor), which is not installed. Fix: pip install -e "
            '".[qlora]" (or pip install "parallelkit[qlora]"), or leave quantize_base out (LoRA on a full-precision '
            "base)."
        ) from err
    return nf4_tensor


def nf4_available() -> None:
    """Raise the error that says how to install torchao, unless it is installed."""
    _nf4_module()


def quantization_scaler_block(numel: int) -> int:
    """Blocks per scaler block of the quantization of a weight of `numel` values: `SCALER_BLOCK` when it divides the
    weight's count of blocks, else the largest size that does; 0 when NF4 cannot hold it (`numel` not a multiple of
    `BLOCK`)."""
    if numel % BLOCK:
        return 0
    blocks = numel // BLOCK
    return next(size for size in range(min(SCALER_BLOCK, blocks), 0, -1) if blocks % size == 0)


def scaler_block_size(numel: int) -> int:
    """Blocks per stored scaler block: the quantization's split into the largest equal parts whose count over the
    weight is a multiple of `SHARDS` (the quantization's own size when no split gets there); 0 as above."""
    size = quantization_scaler_block(numel)
    blocks = numel // BLOCK
    parts = [part for part in range(size, 0, -1) if size % part == 0 and (blocks // part) % SHARDS == 0]
    return parts[0] if parts else size


def to_nf4(weight: torch.Tensor, name: str) -> torch.Tensor:
    """`weight` quantized to an NF4Tensor (named `name` in errors): torchao's quantization with 256-block scaler
    blocks (`quantization_scaler_block`), stored with `scaler_block_size`'s split (the same values)."""
    size, stored = quantization_scaler_block(weight.numel()), scaler_block_size(weight.numel())
    if not size:
        raise ConfigError(
            f"{name} ({tuple(weight.shape)}, {weight.numel()} values) cannot be stored as NF4: its size must be a "
            f"multiple of {BLOCK}. Fix: leave it out of lora.targets, or quantize_base: null."
        )
    nf4 = _nf4_module()
    quantized = nf4.to_nf4(weight.detach(), block_size=BLOCK, scaler_block_size=size)
    if stored == size:
        return quantized
    split = {
        "scaler_block_size": stored,
        "quantization_factor": quantized.quantization_factor.repeat_interleave(size // stored),
    }
    return nf4.NF4Tensor(*nf4.construct_nf4_args(quantized, split))


def release_freed_memory() -> None:
    """Hand the memory the C allocator holds freed back to the system (glibc's `malloc_trim`; nothing elsewhere).

    Quantizing reads each weight whole and frees it; glibc keeps freed blocks of a few MB in its heap, where the next
    weight's blocks rarely fit, so without this a process's resident memory grows by most of the weights it read."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def is_nf4(tensor: Any) -> bool:
    """Whether `tensor` is an NF4Tensor, or a DTensor (FSDP2's shard) holding one."""
    local = getattr(tensor, "_local_tensor", tensor)
    return type(local).__name__ == "NF4Tensor"


def shards_of(weight: torch.Tensor) -> int:
    """How many equal row-wise parts FSDP may cut an NF4 weight into at most: its scaler blocks' count."""
    return weight.numel() // BLOCK // scaler_block_size(weight.numel())
