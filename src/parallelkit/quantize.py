"""4-bit NormalFloat (NF4) base weights for QLoRA, through torchao's `NF4Tensor`.

A frozen weight stored as NF4 holds, per 64 values (a block), 4-bit codes and an 8-bit scale, and per group of
blocks (a scaler block) one more scale: about 0.5 byte per parameter plus scalers, against 4 in fp32. torchao
implements `F.linear` on it (dequantizing on the fly, forward and backward) and FSDP2's all-gather hooks, so a
sharded NF4 weight travels as 4-bit data.

The scaler-block size is chosen per weight, from its size alone, so that a weight has the same quantization in every
layout: the largest one up to torchao's default (256 blocks) leaving a number of scaler blocks that `SHARDS` divides,
since FSDP2 cuts each quantized tensor into equal parts by rows. torchao is the optional extra `[qlora]`, imported
only when a model asks for NF4.
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
"""The number of scaler blocks of every NF4 weight is a multiple of this (when the weight allows), so FSDP can cut
it into 2, 4 or 8 equal parts."""


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


def scaler_block_size(numel: int) -> int:
    """The scaler-block size of a weight of `numel` values (see the module docstring); 0 when NF4 cannot hold it
    (`numel` not a multiple of `BLOCK`)."""
    if numel % BLOCK:
        return 0
    blocks = numel // BLOCK
    divisors = [size for size in range(min(SCALER_BLOCK, blocks), 0, -1) if blocks % size == 0]
    return next((size for size in divisors if (blocks // size) % SHARDS == 0), divisors[0])


def to_nf4(weight: torch.Tensor, name: str) -> torch.Tensor:
    """`weight` quantized to an NF4Tensor (named `name` in errors)."""
    size = scaler_block_size(weight.numel())
    if not size:
        raise ConfigError(
            f"{name} ({tuple(weight.shape)}, {weight.numel()} values) cannot be stored as NF4: its size must be a "
            f"multiple of {BLOCK}. Fix: leave it out of lora.targets, or quantize_base: null."
        )
    return _nf4_module().to_nf4(weight.detach(), block_size=BLOCK, scaler_block_size=size)


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


def nf4_bytes(numel: int) -> int:
    """Bytes of a weight of `numel` values stored as NF4: 4-bit codes, an int8 scale per block, an fp32 scale per
    scaler block, the scales' mean and the 16-value code table (fp32)."""
    blocks = numel // BLOCK
    return numel // 2 + blocks + 4 * (blocks // max(scaler_block_size(numel), 1)) + 4 + 64
