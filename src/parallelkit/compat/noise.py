"""The known-harmless warnings and log lines of Lightning, torch and torchao, silenced by message and module (each
filter matches one message, so every other warning still shows)."""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.nn import Module


class _WithoutTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


class _Without(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(str(record.msg) % record.args if record.args else str(record.msg))


_quieted = False


def quiet_known_noise() -> None:
    """Silence, precisely, what is printed on every run that is neither about the user's code nor actionable:
    Lightning's own use of a torch API that torch 2.13 deprecated and its advertisements for cloud services; and,
    where torchao is installed (transformers imports it with every model), its optional CUDA kernels built for
    another Python failing to load (NF4 needs none of them) and torch telling torchao's developers that registering
    its Enums is deprecated. Every other warning, torch's, torchao's and Lightning's included, still shows. Once per
    process: the `parallelkit` command calls it first of all (its tools import transformers too), and the plugins'
    activation again for a Trainer built from Python."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", module=r"lightning\.pytorch\.utilities"
    )
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_WithoutTips())
    logging.getLogger("torchao").addFilter(_Without(r"^Failed to load .*/torchao/_C[^/]*\.so: "))
    logging.getLogger("torch.utils._pytree").addFilter(
        _Without(r"is an Enum subclass and is now natively supported by torch\.compile")
    )


@contextlib.contextmanager
def lightning_quiet_about_precision() -> Iterator[None]:
    """Within: no "Using bfloat16 Automatic Mixed Precision (AMP)" from a Trainer built to read the run's layout
    (`parallelkit check`), which trains nothing."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    quiet = _Without(r"^Using (16bit|bfloat16) Automatic Mixed Precision")
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def quiet_root_view_warning(root: Module) -> None:
    """FSDP2 warns when a sharded module returns a view: an in-place op on it would drop the module's pre-backward
    hook, which gathers the module's parameters again for backward. Silenced, for this root class only, where that
    hook has nothing to do: parallelkit runs every step as the root's forward (`ParallelkitStrategy._in_root_forward`),
    so a model calling `self(x)` in its step calls the root a second time, and the output of that inner call
    (logits: a view when tensor parallelism hands back its local shard) carries a hook that the step's own output
    carries too; a pipeline stage's root keeps its parameters gathered until its backward (`reshard_after_forward`
    "never", its default). The same warning about any other module still shows."""
    warnings.filterwarnings(
        "ignore",
        message=rf"FSDP2-wrapped module \({re.escape(type(root).__name__)}\) returned a view tensor",
        module=r"torch\.distributed\.fsdp",
    )
