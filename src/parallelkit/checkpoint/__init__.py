"""Checkpoints on disk: atomic publication, compatibility checks, and consolidation to one plain file.

parallelkit strategies save through DCP (Lightning's ModelParallelStrategy I/O): a directory with each rank's
shards (`*.distcp`), DCP's `.metadata`, and Lightning's loop state in `meta.pt`. Parameter names are the
model's own FQNs whatever the layout, so a checkpoint written under one layout loads under another.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from typing_extensions import override

from parallelkit.adapters.lora import is_adapter
from parallelkit.compat import dcp_metadata_global, model_class_name
from parallelkit.errors import ConfigError, ParallelkitError

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


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint that names code to run when read: refused, and nothing in it was run."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` file, refusing every global but the classes DCP metadata is made of.

    A pickle can name any importable function and call it while being read (`os.system`, say); torch's own reader
    uses plain `pickle.load`. Here a name outside `compat.dcp_metadata_global`'s list stops the read before the
    call, so nothing the file names runs.
    """

    def __init__(self, file: BinaryIO, path: Path) -> None:
        super().__init__(file)
        self.path = path

    @override
    def find_class(self, module: str, name: str) -> Any:
        found = dcp_metadata_global(module, name)
        if found is None:
            raise UnsafeCheckpointError(
                f"{self.path} refers to {module}.{name}, which a checkpoint's metadata never holds: reading it "
                "could run code, so it was refused and nothing in it was run. Fix: use a checkpoint a parallelkit "
                "or torch.distributed.checkpoint save wrote, from a source you trust."
            )
        return found


class CheckpointReader(FileSystemReader):
    """DCP's file-system reader, reading `.metadata` with `_MetadataUnpickler` instead of `pickle.load`. Every
    parallelkit load of a sharded checkpoint goes through it (`read_metadata`, `load_sharded`)."""

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file, path).load()
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata.")
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as torch's reader does: DCP tells loads apart by it
        return metadata


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading a checkpoint's non-tensor values (optimizer hyperparameters such as
    `betas`, a strategy's small values) as `torch.load(weights_only=True)` does: torch's planner unpickles them with
    `weights_only=False`, so a value in a `.distcp` file could name code to run."""

    @override
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            value.seek(0)
            unsafe = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(value)) or "unsupported opcodes"
            raise UnsafeCheckpointError(
                f"the checkpoint's value {read_item.dest_index.fqn} holds pickled Python objects ({unsafe}) that "
                "torch.load(weights_only=True) refuses for safety: nothing in it was run. Fix: use a checkpoint "
                "Lightning or parallelkit wrote, from a source you trust."
            ) from err
        checked = io.BytesIO()
        torch.save(loaded, checked)  # the parent's load_bytes places values and reads them from bytes
        checked.seek(0)
        super().load_bytes(read_item, checked)


def load_sharded(state: dict[str, Any], ckpt_dir: str | Path, no_dist: bool = False) -> None:
    """`dcp.load(state, ...)` from the sharded checkpoint at `ckpt_dir`, with nothing in the files run: metadata
    through `CheckpointReader`, non-tensor values as weights_only (tensors DCP reads weights_only itself).
    Collective unless `no_dist`; a rank's failure is every rank's CheckpointError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=CheckpointReader(ckpt_dir), planner=_WeightsOnlyPlanner(), no_dist=no_dist)
    except CheckpointException as err:  # a BaseException: DCP gathers every rank's error into it
        failures = [failure for failure, _ in err.failures.values()]
        ours = next((failure for failure in failures if isinstance(failure, ParallelkitError)), None)
        if ours is not None:
            raise ours from None
        first = " ".join(str(failures[0]).split())[:300] if failures else "no rank said why"
        raise CheckpointError(
            f"the shards of {ckpt_dir} cannot be read ({type(failures[0]).__name__ if failures else 'error'}: "
            f"{first}): the checkpoint is damaged or incomplete. Fix: use another checkpoint (ModelCheckpoint keeps "
            "earlier ones with save_top_k)."
        ) from None


def load_meta(ckpt_dir: Path, weights_only: bool = True) -> dict[str, Any]:
    """The loops' and callbacks' state a sharded checkpoint keeps beside its shards (`meta.pt`); with `weights_only`
    (unless the caller of fit chose otherwise), pickled code in it is refused by name."""
    try:
        return torch.load(ckpt_dir / "meta.pt", weights_only=weights_only)
    except pickle.UnpicklingError as err:
        unsafe = ", ".join(torch.serialization.get_unsafe_globals_in_checkpoint(ckpt_dir / "meta.pt"))
        raise UnsafeCheckpointError(
            f"{ckpt_dir}/meta.pt holds pickled Python objects ({unsafe}) that torch.load(weights_only=True) refuses "
            "for safety: nothing in it was run. Fix: use a checkpoint Lightning or parallelkit wrote."
        ) from err


def read_metadata(ckpt_dir: Path) -> Metadata:
    """A sharded checkpoint's DCP metadata (every saved tensor's name, shape and dtype), or a CheckpointError."""
    if not (ckpt_dir / ".metadata").is_file():
        raise CheckpointError(
            f"{ckpt_dir} is not a sharded (DCP) checkpoint: it has no .metadata file. Pass the checkpoint "
            "directory a parallelkit strategy wrote (it holds *.distcp files and meta.pt)."
        )
    try:
        return CheckpointReader(ckpt_dir).read_metadata()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # cut short or overwritten: unpickling fails in any of several ways
        raise CheckpointError(
            f"{ckpt_dir}/.metadata cannot be read ({type(err).__name__}: {err}): the checkpoint is damaged or "
            "incomplete. Fix: use another checkpoint (ModelCheckpoint keeps earlier ones with save_top_k)."
        ) from err


def check_readable(path: Path, field: str = "ckpt_path") -> None:
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
            f"{field} {file} is not a readable checkpoint ({type(err).__name__}: {err}). Fix: a file torch.save "
            "or Lightning's ModelCheckpoint wrote, or a parallelkit strategy's checkpoint directory."
        ) from err
    if unsafe:
        raise CheckpointError(
            f"{field} {file} holds pickled Python objects ({', '.join(unsafe)}) that torch.load(weights_only=True) "
            "refuses for safety: unpickling them could run any code, so nothing was loaded. Fix: resume from a "
            "checkpoint Lightning or parallelkit wrote (tensors and plain containers); if you trust this file's "
            "origin, load it yourself with torch.load(weights_only=False) and save its tensors again."
        )


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


def consolidate(ckpt_dir: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write the model weights of a sharded checkpoint as one plain state dict (FQN -> tensor) at `out`.

    Runs in one process without a process group. The file is what `torch.load(out, weights_only=True)` reads
    and the unparallelised model's `load_state_dict` takes; it is written atomically. An existing `out` is replaced
    only with `overwrite`.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ckpt_dir, out = Path(ckpt_dir), Path(out)
    check_output(out, overwrite, directory=False)
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
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, staging = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    os.close(handle)
    try:
        torch.save(weights, staging)
        os.replace(staging, out)
    finally:
        Path(staging).unlink(missing_ok=True)
    return out


def check_output(out: Path, overwrite: bool, directory: bool) -> None:
    """Raise a ConfigError unless writing `out` (a file, or with `directory` a directory of files) replaces nothing
    the user has, or `overwrite` allows replacing what the tool writes there."""
    kind = "directory" if directory else "file"
    if out.exists() and out.is_dir() != directory:
        raise ConfigError(
            f"{out} is {'a file' if directory else 'a directory'}, and this writes a {kind} there. Fix: name a new "
            f"{kind}."
        )
    if directory:
        held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    else:
        held = [out.name] if out.exists() else []
    if held and not overwrite:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        where = f"the directory {out} already holds {shown}" if directory else f"{out} already exists"
        raise ConfigError(
            f"{where}, and nothing is replaced without --overwrite. Fix: name a new or empty {kind}, or pass "
            f"--overwrite to replace {'the files this writes there (every other file is kept)' if directory else 'it'}."
        )


def load_in_one_process(state: dict[str, Any], ckpt_dir: str | Path) -> None:
    """Fill `state` (DCP keys -> tensors of the saved shapes) from a sharded checkpoint, in this one process, with no
    process group (DCP then warns that torch.distributed is disabled: that is the intent, so it is not shown)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", module=r"torch\.distributed")
        load_sharded(state, ckpt_dir, no_dist=True)
