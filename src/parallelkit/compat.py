"""Every private Lightning and torch name parallelkit uses, reached through this module only.

parallelkit hooks into internals that Lightning and torch do not promise to keep. Routing each through one
function here means an upgrade that renames or removes one fails in this file, and `tests/test_compat.py` checks
that each still exists with the signature used, naming the one that moved.
"""

from __future__ import annotations

import logging
import re
import warnings
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


class _WithoutTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


def quiet_known_noise() -> None:
    """Silence, precisely, what Lightning prints on every run that is neither about the user's code nor actionable:
    its own use of a torch API that torch 2.13 deprecated, and its advertisements for cloud services. Every other
    warning, torch's and Lightning's included, still shows."""
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", module=r"lightning\.pytorch\.utilities"
    )
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_WithoutTips())


def quiet_root_view_warning(root: Module) -> None:
    """FSDP2 warns when a sharded module returns a view: an in-place op on it would drop the module's pre-backward
    hook. parallelkit runs every step as the root's forward (`ParallelkitStrategy._in_root_forward`), so a model
    that calls `self(x)` inside its step calls the root a second time, and the output of that inner call (logits, a
    view when tensor parallelism hands back its local shard) carries a hook that the step's own output already
    carries. Only that warning, for this root class, is silenced; the same warning about any other module shows."""
    warnings.filterwarnings(
        "ignore",
        message=rf"FSDP2-wrapped module \({re.escape(type(root).__name__)}\) returned a view tensor",
        module=r"torch\.distributed\.fsdp",
    )
