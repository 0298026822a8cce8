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


# Experts: one NF4 quantization per expert, stored as bytes.
#
# torchao's NF4Tensor holds one scaler mean per tensor, so a stacked experts parameter W [E, out, in] is quantized
# expert by expert (`to_nf4(W[e], 64, 256)`, each its own mean) and each expert's quantization kept as one row of
# bytes: codes | per-block scales | scaler factors | mean. The stored parameter [E, bytes] is uint8, so expert
# parallelism divides it by rows (whole experts), FSDP2 shards and all-gathers it as it is (it casts floating-point
# parameters only), and dequantizing a row reproduces torchao's `get_original_weight` of that expert, op for op.

EXPERTS_SUFFIX = "_nf4"
"""The stored parameter of an experts parameter `gate_up_proj` kept in NF4: `gate_up_proj_nf4`."""


def _expert_layout(numel: int, dtype: torch.dtype) -> tuple[tuple[str, int, torch.dtype], ...]:
    """(part, bytes, dtype) of one expert's row: the 4-bit codes, an int8 scale per block, a factor per scaler block
    and the mean, both in the weight's dtype."""
    size = quantization_scaler_block(numel)
    blocks, itemsize = numel // BLOCK, dtype.itemsize
    return (
        ("quantized_data", numel // 2, torch.uint8),
        ("quantized_scalers", blocks, torch.int8),
        ("quantization_factor", blocks // size * itemsize, dtype),
        ("scaler_mean", itemsize, dtype),
    )


def expert_nf4_bytes(numel: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one expert's weight of `numel` values stored as NF4 (a row of `pack_experts`)."""
    return sum(size for _, size, _ in _expert_layout(numel, dtype))


def pack_experts(weight: torch.Tensor, name: str) -> torch.Tensor:
    """`weight` [E, out, in] quantized expert by expert (torchao's `to_nf4(weight[e], 64, 256)`), as uint8 rows
    [E, `expert_nf4_bytes`]; `name` names it in errors."""
    numel = weight[0].numel() if len(weight) else 0
    if not quantization_scaler_block(numel):
        raise ConfigError(
            f"{name} ({tuple(weight.shape)}: {numel} values an expert) cannot be stored as NF4: each expert's size "
            f"must be a multiple of {BLOCK}. Fix: leave it out of lora.targets, or quantize_base: null."
        )
    nf4 = _nf4_module()
    rows = []
    for expert in weight.detach():
        size = quantization_scaler_block(numel)
        quantized = nf4.to_nf4(expert.contiguous(), block_size=BLOCK, scaler_block_size=size)
        layout = _expert_layout(numel, weight.dtype)
        # a copy with standard strides: a tensor of one scaler block may keep its expanded stride, which view refuses
        parts = [
            getattr(quantized, part).reshape(-1).clone(memory_format=torch.contiguous_format) for part, _, _ in layout
        ]
        rows.append(torch.cat([part.view(torch.uint8) for part in parts]))
    return torch.stack(rows) if rows else torch.empty(0, expert_nf4_bytes(numel, weight.dtype), dtype=torch.uint8)


def expert_nf4_parts(stored: torch.Tensor, numel: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The inner tensors of each expert's NF4 in `stored` (rows of `pack_experts` of experts of `numel` values whose
    weight was `dtype`): torchao's names, each with the experts' leading dimension."""
    parts, start = {}, 0
    for part, size, part_dtype in _expert_layout(numel, dtype):
        parts[part] = stored[:, start : start + size].contiguous().view(part_dtype)
        start += size
    parts["scaler_mean"] = parts["scaler_mean"].reshape(-1)
    return parts


_NF4_VALUES: dict[torch.dtype, torch.Tensor] = {}


def _nf4_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 16 values NF4's codes stand for, in `dtype` (torchao's table, as its quantization builds it)."""
    if dtype not in _NF4_VALUES:
        _NF4_VALUES[dtype] = _nf4_module().to_nf4(torch.zeros(BLOCK, dtype=dtype), BLOCK, 1).nf4
    return _NF4_VALUES[dtype].to(device)


def unpack_experts(stored: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The weights [E, *shape] held by `stored` (rows of `pack_experts` of a `dtype` weight), dequantized in `dtype`:
    torchao's `NF4Tensor.get_original_weight` of each expert, computed for all of them at once (the same elementwise
    operations, so the same values)."""
    numel = shape[0] * shape[1]
    parts = expert_nf4_parts(stored, numel, dtype)
    experts, blocks = parts["quantized_scalers"].shape
    factor = parts["quantization_factor"]
    scalers = parts["quantized_scalers"].view(experts, factor.shape[1], -1) / factor.unsqueeze(-1)
    scalers = scalers.reshape(experts, blocks).to(dtype) + parts["scaler_mean"][:, None]
    repeated = scalers.unsqueeze(-1).expand(experts, blocks, BLOCK // 2).reshape(experts, -1)
    values, codes = _nf4_values(dtype, stored.device), parts["quantized_data"]
    first, second = values[(codes >> 4).long()] * repeated, values[(codes & 0b1111).long()] * repeated
    return torch.stack([first, second], dim=-1).reshape(experts, *shape)
