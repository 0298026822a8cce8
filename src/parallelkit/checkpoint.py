"""Checkpoints on disk: atomic publication, compatibility checks, and consolidation to one plain file.

parallelkit strategies save through DCP (Lightning's ModelParallelStrategy I/O): a directory with each rank's
shards (`*.distcp`), DCP's `.metadata`, and Lightning's loop state in `meta.pt`. Parameter names are the
model's own FQNs whatever the layout, so a checkpoint written under one layout loads under another.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallelkit.errors import ParallelkitError
from parallelkit.lora import is_adapter

MODEL_PREFIX = "state_dict."
"""DCP key prefix of model tensors in a Lightning checkpoint directory (optimizer states use `optimizer_<i>.`)."""


class CheckpointError(ParallelkitError, ValueError):
    """A checkpoint that does not fit the model, or is not a checkpoint."""


def remove(path: Path) -> None:
    """Delete a file or directory if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def staging_path(path: Path) -> Path:
    """Where a checkpoint is written before it is complete; Lightning's `ckpt_path="last"` ignores the name."""
    return path.with_name(path.name + ".partial")


def publish(staging: Path, path: Path) -> None:
    """Move a complete checkpoint from `staging` to `path`, replacing an older one there.

    The old checkpoint is renamed aside, not deleted, until the new one is in place: a crash at any moment
    leaves one complete checkpoint under `path` or under `path` + ".old".
    """
    previous = path.with_name(path.name + ".old")
    if path.exists() or path.is_symlink():
        remove(previous)
        os.replace(path, previous)
    os.replace(staging, path)
    remove(previous)


def read_metadata(ckpt_dir: Path) -> Any:
    """A sharded checkpoint's DCP metadata (every saved tensor's name, shape and dtype), or a CheckpointError."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (ckpt_dir / ".metadata").is_file():
        raise CheckpointError(
            f"{ckpt_dir} is not a sharded (DCP) checkpoint: it has no .metadata file. Pass the checkpoint "
            "directory a parallelkit strategy wrote (it holds *.distcp files and meta.pt)."
        )
    try:
        return FileSystemReader(str(ckpt_dir)).read_metadata()
    except Exception as err:  # cut short or overwritten: unpickling fails in any of several ways
        raise CheckpointError(
            f"{ckpt_dir}/.metadata cannot be read ({type(err).__name__}: {err}): the checkpoint is damaged or "
            "incomplete. Fix: use another checkpoint (ModelCheckpoint keeps earlier ones with save_top_k)."
        ) from err


def check_readable(path: Path) -> None:
    """Raise a CheckpointError unless `path` is a checkpoint to resume from: a file torch.save wrote, or a sharded
    directory with readable `.metadata` and `meta.pt`, holding nothing `torch.load(weights_only=True)` refuses.

    What it refuses (pickled classes and functions, whose unpickling can run any code) is named; the check reads the
    pickle's opcodes, and nothing in the file is unpickled.
    """
    if not path.exists():
        raise CheckpointError(
            f"ckpt_path {path} does not exist. Fix: the path of a checkpoint file or directory (ModelCheckpoint's "
            "dirpath/<name>.ckpt), or ckpt_path=last to resume from this run's newest."
        )
    file = path
    if path.is_dir():
        read_metadata(path)
        file = path / "meta.pt"  # Lightning's loop and callback state next to the shards
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except Exception as err:  # missing, not a zip archive, truncated
        raise CheckpointError(
            f"ckpt_path {file} is not a readable checkpoint ({type(err).__name__}: {err}). Fix: a file torch.save "
            "or Lightning's ModelCheckpoint wrote, or a parallelkit strategy's checkpoint directory."
        ) from err
    if unsafe:
        raise CheckpointError(
            f"ckpt_path {file} holds pickled Python objects ({', '.join(unsafe)}) that torch.load(weights_only=True) "
            "refuses for safety: unpickling them could run any code, so nothing was loaded. Fix: resume from a "
            "checkpoint Lightning or parallelkit wrote (tensors and plain containers); if you trust this file's "
            "origin, load it yourself with torch.load(weights_only=False) and save its tensors again."
        )


def model_class_name(model: nn.Module) -> str:
    """The model's own class name (fully_shard swaps in a generated `FSDP<Name>` subclass)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__


def check_compatible(
    model: nn.Module, ckpt: Path, saved: Mapping[str, Any] | None = None, names: Iterable[str] | None = None
) -> None:
    """Raise a CheckpointError naming every parameter whose shape differs or that the checkpoint lacks.

    `saved`: the model tensors of a single-file checkpoint (its "state_dict"); without it, `ckpt` is a sharded
    checkpoint directory and its metadata is read. `names`: the state-dict keys the checkpoint must hold (None:
    every one of the model's; a LoRA run's checkpoints hold its adapters only).
    """
    if saved is None:
        meta = read_metadata(ckpt).state_dict_metadata.items()
        shapes = {k[len(MODEL_PREFIX) :]: getattr(v, "size", None) for k, v in meta if k.startswith(MODEL_PREFIX)}
    else:
        shapes = {k: getattr(v, "shape", None) for k, v in saved.items()}
    problems = []
    wanted = None if names is None else set(names)
    for name, tensor in model.state_dict().items():
        if wanted is not None and name not in wanted:
            continue
        if name not in shapes:
            problems.append(f"{name} is missing")
        elif shapes[name] is not None and tuple(shapes[name]) != tuple(tensor.shape):
            problems.append(f"{name} is {tuple(shapes[name])} in the checkpoint but {tuple(tensor.shape)} in the model")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        adapters_only = bool(shapes) and all(is_adapter(k) for k in shapes)
        hint = " (it holds LoRA adapters only: give the model the lora settings it was trained with)" * adapters_only
        raise CheckpointError(
            f"checkpoint {ckpt} does not fit {model_class_name(model)}: {shown}. Load it into the model "
            f"configuration it was saved from{hint}."
        )


def consolidate(ckpt_dir: str | Path, out: str | Path) -> Path:
    """Write the model weights of a sharded checkpoint as one plain state dict (FQN -> tensor) at `out`.

    Runs in one process without a process group. The file is what `torch.load(out, weights_only=True)` reads
    and the unparallelised model's `load_state_dict` takes; it is written atomically.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt_dir, out = Path(ckpt_dir), Path(out)
    saved = read_metadata(ckpt_dir).state_dict_metadata
    state = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in saved.items()
        if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
    }
    if not state:
        raise CheckpointError(f"{ckpt_dir} holds no model tensors (no '{MODEL_PREFIX}*' keys).")
    load_in_one_process(state, ckpt_dir)
    weights = {key[len(MODEL_PREFIX) :]: tensor for key, tensor in state.items()}
    staging = staging_path(out)
    torch.save(weights, staging)
    publish(staging, out)
    return out


def load_in_one_process(state: dict[str, Any], ckpt_dir: str | Path) -> None:
    """Fill `state` (DCP keys -> tensors of the saved shapes) from a sharded checkpoint, in this one process, with no
    process group (DCP then warns that torch.distributed is disabled: that is the intent, so it is not shown)."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", module=r"torch\.distributed")
        dcp.load(state, checkpoint_id=str(ckpt_dir), no_dist=True)
