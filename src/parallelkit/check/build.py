"""A run's Trainer, model and datamodule from its config, as `fit` reads it, without training anything."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TRAINER_KEYS = ("accelerator", "strategy", "devices", "num_nodes", "precision", "plugins")
"""The Trainer arguments that decide the processes, devices and layout (the rest is training, not checked)."""


def trainer_of(config: str, overrides: Sequence[str]) -> tuple[Any, Any, Any]:
    """(Trainer, model, datamodule) of the run `config` describes: the model on the meta device, the Trainer with
    the config's strategy, devices and nodes (its launcher ready), no logger, callbacks or checkpointing."""
    from lightning.pytorch import Trainer

    from parallelkit.cli import _PlanCLI

    cli = _PlanCLI(config, overrides)
    settings = dict(cli.config_init["trainer"])
    kwargs = {key: settings[key] for key in TRAINER_KEYS if settings.get(key) is not None}
    trainer = Trainer(
        **kwargs, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    return trainer, cli.model, cli.datamodule
