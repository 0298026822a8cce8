"""Every private Lightning and torch name parallelkit uses, reached through this module only.

parallelkit hooks into internals that Lightning and torch do not promise to keep. Routing each through one
function here means an upgrade that renames or removes one fails in this file, and `tests/test_compat.py` checks
that each still exists with the signature used, naming the one that moved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn import Module


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """One mesh axis named `name` spanning every axis of `mesh` (a sub-mesh of the root). torch 2.13:
    `DeviceMesh._flatten`, the only way to get one group spanning several mesh axes."""
    return mesh._flatten(name)


def flattened_meshes(root: DeviceMesh) -> dict[str, DeviceMesh]:
    """The meshes `flatten_mesh` made from `root`, by name (torch keeps them on the root mesh)."""
    return root._flatten_mapping


def run_as_forward(module: Module, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call `module.<method>(*args, **kwargs)` through `module(...)`, so that its forward hooks run around it.
    Lightning's `_ForwardRedirection`, which its DDP and FSDP1 strategies use on their wrappers."""
    from lightning.pytorch.strategies.strategy import _ForwardRedirection

    return _ForwardRedirection()(module, module, method, *args, **kwargs)
