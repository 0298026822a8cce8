"""A template parallelkit plugin: a strategy and a comm hook, each found by name through an entry point."""

from typing import Any

import torch

from parallelkit import CommHook, FSDPTPStrategy
from parallelkit.strategies.base import MeshShape


class ZeRO2Strategy(FSDPTPStrategy):
    """ZeRO-2 style FSDP: every process shards gradients and optimizer state, and gathered weights stay after
    forward (no second all-gather in backward; more memory than fsdp2).

    Args:
        mesh_shape: as in `parallelkit.FSDPTPStrategy`; "auto": every process shards.
        **kwargs: the other `parallelkit.FSDPTPStrategy` arguments.
    """

    plugin_api = 1  # the parallelkit.PLUGIN_API this plugin is written against

    def __init__(self, mesh_shape: MeshShape = "auto", **kwargs: Any) -> None:
        kwargs.setdefault("reshard_after_forward", "never")
        super().__init__(mesh_shape=mesh_shape, **kwargs)


class TemplateBF16(CommHook):
    """Gradients reduced in bf16 under the plugin's own name (set `reduce_dtype`; override `configure(module)`
    to replace an FSDP2 module's reduce-scatter, `ddp_hook()` to give the hook a DDP form)."""

    plugin_api = 1
    name = "template_bf16"
    reduce_dtype = torch.bfloat16
    bytes_ratio = 0.5


__all__ = ["TemplateBF16", "ZeRO2Strategy"]
