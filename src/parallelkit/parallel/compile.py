"""Compile: each block's forward through `torch.compile`, after tensor parallelism and checkpointing, before FSDP."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from parallelkit.parallel.fsdp import Unit


def apply_compile(units: list[Unit], backend: str, checkpointed: Sequence[nn.Module] = ()) -> None:
    """Compile each block's `forward` with `torch.compile(backend=backend)`; those in `checkpointed` recompute their
    activations in backward, by `torch.utils.checkpoint` inside the compiled code.

    Per block, as the field's reference trainers do: blocks repeat, so one compilation serves them all, and the
    embedding, head and loss stay eager. Only `forward` is compiled, not the module's call: the hooks of tensor
    parallel's children run inside the compiled code, while those on the block itself (FSDP's gathers) stay outside
    it, and parameter names, so checkpoints, are those of the eager model. Checkpointing is traced with the block,
    not hooked around it. While saved-tensor hooks are active (e.g. the activation monitors' ledger) the compiled code
    runs under hooks of its own that keep each tensor as it is: torch 2.13's dynamo traces the active hooks and fails
    on FSDP's DTensor parameters; so activation monitors do not see what compiled blocks save for backward. Only then,
    as they cost 3-5% of a block's step on CPU (a run that has both compiles the blocks a second time: dynamo's guards
    check the active hooks).
    """
    import functools

    from torch.utils.checkpoint import checkpoint

    from parallelkit.compat import saved_tensors_hooks_active, settle_async_collectives

    def compiled_forward(module: nn.Module) -> Any:
        run = module.forward
        if any(module is m for m in checkpointed):
            run = functools.partial(checkpoint, module.forward, use_reentrant=False)
        compiled = torch.compile(run, backend=backend)

        def forward(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = settle_async_collectives((args, kwargs))
            if not saved_tensors_hooks_active():
                return compiled(*args, **kwargs)
            with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                return compiled(*args, **kwargs)

        return forward

    for unit in units:
        for module in unit if isinstance(unit, list) else [unit]:
            module.forward = compiled_forward(module)


def _keep(tensor: Any) -> Any:
    """A saved-tensor hook that keeps the tensor as it is."""
    return tensor


def compile_backends() -> list[str]:
    """The backends `torch.compile` knows (inductor, aot_eager, eager, ...)."""
    return torch.compiler.list_backends(exclude_tags=())


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would build CPU kernels with, if there is one."""
    import os
    import shutil

    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((path for name in names if (path := shutil.which(name))), None)
