"""Precision for sharded models: FSDP2's own mixed precision in place of autocast, and clipping by the global norm."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

from parallelkit.errors import ConfigError
from parallelkit.optimizers.grad_norm import clip_grad_norm_

PRECISIONS = {"32-true": None, "bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16}
"""Trainer precisions a parallelkit strategy runs, with the dtype FSDP2 computes in (None: fp32)."""


class ShardedPrecision(Precision):
    """Precision for sharded models: FSDP2 casts parameters itself (no autocast), and gradient clipping by norm
    measures the global norm across every shard and stage."""

    def __init__(self, precision: str, stage_group: Any = None) -> None:
        if precision not in PRECISIONS:
            raise ConfigError(
                f"Trainer(precision={precision!r}) is not supported by parallelkit strategies; use one of "
                f"{', '.join(PRECISIONS)} (bf16-mixed computes in bf16 and keeps fp32 weights and gradients)."
            )
        self.precision = precision
        self.stage_group = stage_group

    @property
    def param_dtype(self) -> torch.dtype | None:
        return PRECISIONS[self.precision]

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(torch.bfloat16) if self.precision == "bf16-true" else module

    @override
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        clip_grad_norm_(self.main_params(optimizer), clip_val, stage_group=self.stage_group)
