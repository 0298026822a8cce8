"""The frozen reference of preference tuning, parallelised exactly as the model it is a copy of.

A model that wants one (`parallelkit.contract.FROZEN_REFERENCE`: DPO without adapters) hands the strategy a
copy of its network under its own module names before the model is parallelised. Once the model is parallelised and
holds its starting values (pretrained or the seed's, before a checkpoint's are restored: the reference is the model as
this training began, on a resume too), the copy gets the same plan (pipeline stages, tensor, expert and context
parallelism, FSDP units and mixed precision) and then each of the model's local shards: no gather, no second read of
the weights. It is never trained: no gradients, no optimizer state, no place in checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from parallelkit.compat import apply_to_tensors
from parallelkit.contract import FROZEN_REFERENCE
from parallelkit.errors import ConfigError
from parallelkit.init import retie, tied_parameters


def wanted_reference(module: Any) -> nn.Module | None:
    """The copy `module` asks for (`frozen_reference()`), or None; made before the module is parallelised."""
    hook = getattr(module, FROZEN_REFERENCE, None)
    return hook() if callable(hook) else None


def build_reference(
    strategy: Any, reference: nn.Module, parallelize: Any, stages: Sequence[int] | None = None
) -> list[nn.Module]:
    """Parallelise `reference` as the strategy parallelised its model (`parallelize(module, mesh, **options)`), on
    the model's device and precision, and give it the model's local values, parameters and buffers by name. With
    `stages` (this rank's pipeline stages), the copy is split as the model and its stages run the plan's stage
    forward on the copy (`reference.on_copy`). Returns the modules to run, as `parallelize`."""
    options = {**strategy.parallelize_options(), "prepare": None}
    if stages is not None:
        resolved = options["resolved"]
        forward = reference.on_copy(resolved.plan.stage_forward)
        options.update(resolved=replace(resolved, plan=replace(resolved.plan, stage_forward=forward)), stages=stages)
    roots = parallelize(reference, strategy.device_mesh, **options)
    device = next(strategy.model.parameters()).device
    tied = tied_parameters(reference)
    apply_to_tensors(reference, lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
    retie(reference, tied)
    values = {**dict(strategy.model.named_parameters()), **dict(strategy.model.named_buffers())}
    with torch.no_grad():
        for name, tensor in [*reference.named_parameters(), *reference.named_buffers()]:
            source = values.get(name)
            if source is None:
                raise ConfigError(f"the frozen reference has {name}, which the model does not: it is not its copy.")
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            local.copy_(source.to_local() if isinstance(source, DTensor) else source)
    reference.requires_grad_(False)
    reference.eval()
    for root in roots:
        if isinstance(root, FSDPModule):  # forward only: the root too gives back its gathered parameters after it
            root.set_reshard_after_forward(True)
    strategy.precision_plugin.convert_module(reference)
    return roots
