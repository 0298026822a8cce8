"""Experiment tracking: Lightning's WandbLogger, offline unless this machine has a wandb account to stream to; a
resumed fit logging on where the run it resumes logged (`continue_logged_run`)."""

from __future__ import annotations

import csv
import netrc
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.utilities import rank_zero_only

from parallelkit.checkpoint import load_meta
from parallelkit.compat import logger_version, set_logger_version


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


VERSION_DIR = re.compile(r"version_(\d+)")
"""A directory Lightning's CSV and TensorBoard loggers make for a run under their `root_dir`."""


def continue_logged_run(trainer: L.Trainer, ckpt_path: object) -> None:
    """Make a fit that resumes `ckpt_path` log where the run that saved it logged.

    A CSV or TensorBoard logger given no version picks the next free `version_<n>` directory, so a resume used to log
    to a new one: the run's logs were split in two, and its ModelCheckpoint, which saves under the logger's version
    directory unless given a `dirpath`, saved in another directory than the one it had saved in (Lightning then warns
    on every rank that "the dirpath has changed" and forgets the checkpoints it kept there; and `ckpt_path="last"`
    looked for `last.ckpt` in the new, empty directory and trained from scratch). Here a logger without a version
    whose `version_<n>` directory holds the checkpoint resumed (for "last": the newest `last` checkpoint that
    Lightning would find, under any of its version directories) takes that version. Its CSV file keeps the saving
    run's rows of the steps before the checkpoint's, and the resumed run's rows follow them.
    """
    checkpoint = resumed_checkpoint(trainer, ckpt_path)
    if checkpoint is None:
        return
    for index, logger in enumerate(trainer.loggers):
        if not isinstance(logger, (CSVLogger, TensorBoardLogger)) or logger_version(logger) is not None:
            continue
        version = version_holding(Path(logger.root_dir), checkpoint)
        if version is None:
            continue
        set_logger_version(logger, version)
        if index == 0:  # where ModelCheckpoint saves by default: not empty, as a resumed run expects it
            saves = re.escape(os.path.join(logger.root_dir, f"version_{version}", "checkpoints"))
            warnings.filterwarnings("ignore", message=f"Checkpoint directory {saves} exists and is not empty")
        if isinstance(logger, CSVLogger) and rank_zero_only.rank == 0:
            keep_csv_rows_before(logger, checkpoint_step(checkpoint))


def resumed_checkpoint(trainer: L.Trainer, ckpt_path: object) -> Path | None:
    """The checkpoint a fit given `ckpt_path` resumes: a path, or for "last" the newest `last` checkpoint of its
    ModelCheckpoint callbacks' directories, those under the logger's version directories included (None for
    Lightning's other names, a URL, or nothing to resume)."""
    if ckpt_path == "last":
        return newest_last(trainer)
    named = str(ckpt_path) in ("best", "hpc") or ":" in str(ckpt_path)  # Lightning's names, URLs, registry:<name>
    return Path(ckpt_path) if isinstance(ckpt_path, (str, os.PathLike)) and not named else None


def newest_last(trainer: L.Trainer) -> Path | None:
    """The newest `last*.ckpt` (by modification time, as Lightning picks) in the directories of the trainer's
    ModelCheckpoint callbacks; one given no `dirpath` saves under the first logger's version directory, each of
    which is searched while that logger has not chosen its version."""
    first = trainer.loggers[0] if trainer.loggers else None
    found: list[Path] = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        if callback.dirpath is not None:
            directories = [Path(callback.dirpath)]
        elif isinstance(first, (CSVLogger, TensorBoardLogger)) and logger_version(first) is None:
            directories = [d / "checkpoints" for d in Path(first.root_dir).glob("version_*")]
        else:
            directories = []  # the logger's own directory: Lightning finds it there itself
        pattern = re.compile(rf"{re.escape(callback.CHECKPOINT_NAME_LAST)}(-\d+)?")
        found += [
            path
            for directory in directories
            if directory.is_dir()
            for path in directory.iterdir()
            if path.suffix == callback.FILE_EXTENSION and pattern.fullmatch(path.stem)
        ]
    return max(found, key=lambda path: path.stat().st_mtime) if found else None


def version_holding(root_dir: Path, checkpoint: Path) -> int | None:
    """n, when `checkpoint` lies in `root_dir`/version_<n>/ (a logger's directory for one run)."""
    try:
        parts = checkpoint.resolve().relative_to(root_dir.resolve()).parts
    except ValueError:
        return None
    match = VERSION_DIR.fullmatch(parts[0]) if len(parts) > 1 else None
    return int(match.group(1)) if match else None


def checkpoint_step(checkpoint: Path) -> int | None:
    """The global step a checkpoint was saved at (None when it cannot be read: loading it will say why)."""
    try:
        if checkpoint.is_dir():  # a sharded checkpoint: the loops' state is in meta.pt
            return int(load_meta(checkpoint)["global_step"])
        return int(torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)["global_step"])
    except (OSError, KeyError, TypeError, ValueError, RuntimeError, pickle.UnpicklingError):
        return None


def keep_csv_rows_before(logger: CSVLogger, step: int | None) -> None:
    """Start the CSV logger's writer on its version directory keeping the rows of `metrics.csv` logged before `step`
    (all of them when it is None): Lightning's writer deletes the file of a directory it finds in use."""
    metrics = Path(logger.log_dir) / "metrics.csv"
    rows, keys = [], []
    if metrics.is_file():
        with open(metrics, newline="") as file:
            reader = csv.DictReader(file)
            rows, keys = list(reader), list(reader.fieldnames or [])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
        writer = logger.experiment
    if not keys:
        return
    kept = [row for row in rows if step is None or not row.get("step") or int(float(row["step"])) < step]
    with open(metrics, "w", newline="") as file:
        table = csv.DictWriter(file, fieldnames=keys)
        table.writeheader()
        table.writerows(kept)
    writer.metrics_keys = keys  # its rows are appended under this header (rewritten wider when new keys come)
