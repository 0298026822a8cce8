"""Hugging Face checkpoints in: the tensors of a directory as `save_pretrained` writes it, read box by box.

A directory holds `config.json` and `model.safetensors`, or shards listed by `model.safetensors.index.json`. Each
rank reads, tensor by tensor, only the box of each tensor it holds (plain file reads at the offsets the safetensors
headers give), so under `meta_init` no rank ever holds the whole model, whatever the layout. Every header is checked
against its file (cut short, damaged, a git-lfs pointer) before any read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from parallelkit.adapters.nf4 import is_nf4
from parallelkit.compat import local_box
from parallelkit.errors import ConfigError
from parallelkit.init import tied_parameters

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsWeights:
    """The tensors of a `save_pretrained` directory, by name: their shapes, and boxes of them read on demand.

    Read with plain file reads at the offsets the safetensors headers give (the format is a JSON header, then
    each tensor's bytes, row-major), not through a memory map: mapped pages a process has read count in its
    resident memory until unmapped, file reads leave them to the page cache. A box whole in every dim but the first
    is one contiguous read; another box reads its rows whole, then keeps its columns (one tensor at a time).
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        if not (self.directory / "config.json").is_file():
            raise ConfigError(
                f"pretrained={str(directory)!r} is not a Hugging Face model directory: it has no config.json. "
                f"Fix: the directory save_pretrained wrote (config.json + model.safetensors or its shards); "
                "nothing is downloaded, hub names are not accepted."
            )
        if (self.directory / INDEX).is_file():
            files = sorted(set(_weight_map(self.directory / INDEX).items()))
            listed = {}
            for name, file in files:
                listed.setdefault(file, name)
            for file, name in listed.items():
                if not (self.directory / file).is_file():
                    raise ConfigError(
                        f"{self.directory / INDEX} lists {file} (holding {name}, among others), which is missing. "
                        "Fix: copy every shard the index names into the directory."
                    )
            paths = [self.directory / file for file in listed]
        elif (self.directory / WEIGHTS).is_file():
            paths = [self.directory / WEIGHTS]
        else:
            found = ", ".join(sorted(p.name for p in self.directory.iterdir())[:10])
            raise ConfigError(
                f"pretrained={str(directory)!r} holds no safetensors weights ({WEIGHTS} or {INDEX}); it has: {found}. "
                "Fix: save the model with save_pretrained(..., safe_serialization=True) (PyTorch .bin weights are "
                "not read)."
            )
        self.entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int]] = {}
        for path in paths:
            self.entries.update(_tensor_entries(path))
        self.files = {name: entry[0] for name, entry in self.entries.items()}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The part `box` of tensor `name` (one slice per dim)."""
        path, dtype, shape, offset = self.entries[name]
        if not shape:
            rows, rest = slice(0, 1), ()
            shape = (1,)
        else:
            rows, rest = box[0], box[1:]
        out = torch.empty((rows.stop - rows.start, *shape[1:]), dtype=dtype)
        row_bytes = out[0].numel() * out.element_size() if len(out) else 0
        with open(path, "rb", buffering=0) as f:
            f.seek(offset + rows.start * row_bytes)
            buffer, done = memoryview(out.view(torch.uint8).numpy()).cast("B"), 0
            while done < len(buffer):
                read = f.readinto(buffer[done:])
                if not read:  # the header was checked against the file's size: it shrank since
                    raise ConfigError(
                        f"{path} ended while reading {name} ({done} of {len(buffer)} bytes read): the file was cut "
                        f"short or changed while training started. {REDOWNLOAD}"
                    )
                done += read
        return out[(slice(None), *rest)] if box else out.reshape(())


REDOWNLOAD = "Fix: download or save the model again (a git clone of a model repository needs `git lfs pull`)."

LFS_POINTER = b"version https://git-lfs.github.com/spec/"
"""How a git-lfs pointer file starts: what a clone without git-lfs leaves in place of each weights file."""


def _weight_map(index: Path) -> dict[str, str]:
    """The tensor -> file map of a sharded checkpoint's index, or a ConfigError naming the damaged index."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise TypeError("names and files are not strings")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ConfigError(
            f"{index} is not a safetensors index ({type(err).__name__}: {err}): it should be JSON with a "
            f"'weight_map' of tensor name -> shard file. {REDOWNLOAD}"
        ) from None
    return weight_map


def _tensor_entries(path: Path) -> dict[str, tuple[Path, torch.dtype, tuple[int, ...], int]]:
    """{tensor name: (file, dtype, shape, byte offset)} from a safetensors file's header, every entry checked
    against the file's size, so that a file cut short, a damaged header or a git-lfs pointer in place of the
    weights is one error naming the file (and the tensor), before any read."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        start = f.read(max(8, len(LFS_POINTER)))
        if start.startswith(LFS_POINTER):
            raise ConfigError(
                f"{path} is a git-lfs pointer ({size} bytes of text), not the weights: the repository was cloned "
                f"without its large files. Fix: run `git lfs pull` in {path.parent} (or download the file again)."
            )
        length = int.from_bytes(start[:8], "little")
        if size < 8 or 8 + length > size:
            raise ConfigError(
                f"{path} is {size} bytes, shorter than its own header says ({8 + length} bytes before the first "
                f"tensor): the file is cut short. {REDOWNLOAD}"
            )
        f.seek(8)
        try:
            header = json.loads(f.read(length))
        except ValueError as err:
            header = err
    if not isinstance(header, dict):
        raise ConfigError(f"{path} has a header that is not a safetensors JSON header ({header}). {REDOWNLOAD}")
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(
                f"{path} describes tensor {name} as {entry!r}, which is not a safetensors entry (a dtype among "
                f"{', '.join(SAFETENSORS_DTYPES)}, a shape and two data offsets; {type(err).__name__}: {err}). "
                f"{REDOWNLOAD}"
            ) from None
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != nbytes:
            raise ConfigError(
                f"{path} gives tensor {name} (shape {list(shape)}, {entry['dtype']}: {nbytes} bytes) the bytes "
                f"{begin}..{end}: the header is damaged. {REDOWNLOAD}"
            )
        if 8 + length + end > size:
            raise ConfigError(
                f"{path} ends at byte {size}, but its tensor {name} runs to byte {8 + length + end}: the file is cut "
                f"short (a download that did not finish). {REDOWNLOAD}"
            )
        entries[name] = (path, dtype, shape, 8 + length + begin)
    return entries


def load_weights(module: nn.Module, weights: SafetensorsWeights, skip: Callable[[str], bool] = lambda _: False) -> None:
    """Fill what this rank holds of `module`'s parameters and persistent buffers (a transformers model; the
    checkpoint's names are its state-dict keys) from `weights`: each sharded tensor's local box, each whole one
    whole. Layers another pipeline rank holds (still on the meta device) are skipped, and so are the tensors `skip`
    names (LoRA adapters, which the base model's checkpoint does not hold). Tied parameters are read once, under
    whichever of their names the checkpoint holds (transformers saves one)."""
    tied = {name: group for group in tied_parameters(module) for name in group}
    done: set[int] = set()
    missing = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in done or tensor.is_meta or skip(name) or is_nf4(tensor):  # NF4: quantized when read
            continue
        key = next((n for n in tied.get(name, [name]) if n in weights.files), None)
        if key is None:
            if isinstance(tensor, nn.Parameter):
                missing.append(name)
            continue  # a buffer the model computes (e.g. rotary tables)
        expected = tuple(tensor.shape)
        if weights.shape(key) != expected:
            raise ConfigError(
                f"{weights.files[key]} holds {key} of shape {list(weights.shape(key))}, but the model built from "
                f"{weights.directory / 'config.json'} expects {list(expected)}: the config does not match the "
                "weights. Fix: load the weights with the config.json saved beside them (model.init_args.config: "
                "null)."
            )
        local, offsets = local_box(tensor)
        if local.numel():
            box = tuple(slice(start, start + size) for start, size in zip(offsets, local.shape))
            with torch.no_grad():
                local.copy_(weights.read(key, box))
        done.add(id(tensor))
    if missing:
        raise ConfigError(
            f"{weights.directory} lacks {len(missing)} of the model's parameters ({', '.join(missing[:5])}"
            f"{', ...' if len(missing) > 5 else ''}): the config does not match the weights. Fix: load the weights "
            "with the config.json saved beside them."
        )
