"""Experiment tracking: Lightning's WandbLogger, offline unless this machine has a wandb account to stream to."""

from __future__ import annotations

import netrc
import os
from typing import Any

from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger


def wandb_account_configured() -> bool:
    """Whether wandb has credentials here: WANDB_API_KEY, or the ~/.netrc entry `wandb login` writes."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbLogger(LightningWandbLogger):
    """Lightning's WandbLogger, which by default runs offline unless it can stream: it logs to `save_dir/wandb/` and
    `wandb sync <run dir>` uploads a run later.

    Args:
        offline: True: log to disk only; False: stream to the wandb server. Default (None): as the environment
            variable WANDB_MODE says when it is set (online, offline, disabled), otherwise online only where wandb
            has an account configured (`wandb login` or WANDB_API_KEY).
        **kwargs: Lightning's WandbLogger arguments (save_dir, project, name, log_model, ...).
    """

    def __init__(self, offline: bool | None = None, **kwargs: Any) -> None:
        if offline is None:
            # Lightning's offline=True overwrites WANDB_MODE; left False, wandb itself reads WANDB_MODE.
            offline = not os.environ.get("WANDB_MODE") and not wandb_account_configured()
        super().__init__(offline=offline, **kwargs)
