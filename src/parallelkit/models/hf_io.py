"""Hugging Face checkpoints in and out.

In: a directory as `save_pretrained` writes it (`config.json` and `model.safetensors`, or shards listed by
`model.safetensors.index.json`). Each rank reads, tensor by tensor, only the box of each tensor it holds (safetensors
slice reads from a memory map), so under `meta_init` no rank ever holds the whole model, whatever the layout.

Out: a parallelkit checkpoint (sharded DCP directory or single file) of an `HFCausalLM` written back as such a
directory, one safetensors shard at a time (peak memory about one shard, no process group, no GPU), with
`config.json` and the tokenizer files of the directory the model came from.

Over 400 lines: reading and writing the one format (safetensors directories) share its names, shapes and
trust checks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from parallelkit.checkpoint import (
    MODEL_PREFIX,
    CheckpointError,
    check_output,
    check_readable,
    load_in_one_process,
    load_meta,
    read_metadata,
)
from parallelkit.compat import local_box
from parallelkit.errors import ConfigError
from parallelkit.init import tied_parameters
from parallelkit.lora import is_adapter
from parallelkit.quantize import is_nf4

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",  # transformers 5 saves a tokenizer's chat template here
    "chat_template.json",
    "generation_config.json",
)
"""Files besides the weights that travel with a model directory (tokenizer, generation defaults)."""

HF_MODULE = "model."
"""Where `HFCausalLM` holds the transformers model: its state-dict keys are the checkpoint's, prefixed."""


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


# -- out ---------------------------------------------------------------------------------------------------------
def _saved_tensors(ckpt: Path) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], torch.dtype]], Any]:
    """(the checkpoint's non-tensor contents, {model key: (shape, dtype)}, a loader of {model key: tensor})."""
    if ckpt.is_dir():
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        entries = {
            key[len(MODEL_PREFIX) :]: (tuple(entry.size), entry.properties.dtype)
            for key, entry in read_metadata(ckpt).state_dict_metadata.items()
            if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
        }

        def load(keys: Iterable[str]) -> dict[str, torch.Tensor]:
            state = {MODEL_PREFIX + k: torch.empty(entries[k][0], dtype=entries[k][1]) for k in keys}
            load_in_one_process(state, ckpt)
            return {k[len(MODEL_PREFIX) :]: v for k, v in state.items()}

        return load_meta(ckpt), entries, load
    checkpoint = torch.load(ckpt, mmap=True, map_location="cpu", weights_only=True)  # check_readable saw no code
    weights = checkpoint.pop("state_dict")
    entries = {k: (tuple(v.shape), v.dtype) for k, v in weights.items()}
    return checkpoint, entries, lambda keys: {k: weights[k].contiguous() for k in keys}


def export_hf(
    ckpt: str | Path,
    out: str | Path,
    max_shard_size: float = 5e9,
    tokenizer: str | Path | None = None,
    adapters: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write the `HFCausalLM` weights of a parallelkit checkpoint as a directory `from_pretrained` loads.

    Safetensors shards of at most `max_shard_size` bytes (one tensor larger than that gets a shard of its own),
    with an index when there are several, as transformers writes them; `config.json` from the model's config;
    tokenizer files from `tokenizer`, else from the directory the model was loaded from. Tied weights are written
    once, under the first name, as transformers does.

    Written in a new directory beside `out` and moved in when complete. `out` must be new or empty unless
    `overwrite`: then the files an export writes are replaced (the weights as a set: shards or a single file an
    earlier export left are removed, so that the directory holds one model), and every other file is kept.

    A LoRA run's checkpoint (its adapters only) is written merged into its base weights (read from the `pretrained`
    directory it was trained from), or with `adapters=True` as the adapters alone in PEFT's format
    (`adapter_config.json` + `adapter_model.safetensors`, which `peft.PeftModel.from_pretrained` puts on the base).
    """
    ckpt, out = Path(ckpt), Path(out)
    if not ckpt.exists():
        raise CheckpointError(f"{ckpt} does not exist. Fix: the path of a checkpoint a parallelkit run wrote.")
    if max_shard_size <= 0:
        raise ConfigError(f"max_shard_size={max_shard_size:g} bytes is not a size. Fix: a positive size, e.g. 5e9.")
    if tokenizer is not None and not any((Path(tokenizer) / name).is_file() for name in TOKENIZER_FILES):
        state = "holds none of the tokenizer files" if Path(tokenizer).is_dir() else "is not a directory"
        raise ConfigError(
            f"--tokenizer {tokenizer} {state} ({', '.join(TOKENIZER_FILES[:4])}, ...). Fix: the directory the "
            "tokenizer was saved in (tokenizer.save_pretrained), or leave --tokenizer out to copy the pretrained "
            "directory's."
        )
    check_output(out, overwrite, directory=True)
    check_readable(ckpt, field="checkpoint")
    rest, entries, load = _saved_tensors(ckpt)
    hparams = rest.get("hyper_parameters") or {}
    source = hparams.get("config") or hparams.get("pretrained")
    if source is None or not any(k.startswith(HF_MODULE) for k in entries):
        raise CheckpointError(
            f"{ckpt} is not a checkpoint of parallelkit.models.HFCausalLM (its hyper_parameters name no config and "
            "its weights no 'model.*' tensors). Fix: export-hf takes HFCausalLM checkpoints; for any other model use "
            "parallelkit consolidate."
        )
    lora = hparams.get("lora")
    adapted = sorted({k.rpartition(".")[0] for k in entries if is_adapter(k)})
    if adapters and not adapted:
        raise CheckpointError(
            f"{ckpt} holds no LoRA adapters (its run had no model.init_args.lora). Fix: export it without --adapters."
        )
    if adapted and not lora:
        raise CheckpointError(
            f"{ckpt} holds LoRA adapters ({adapted[0]}, ...) but its hyper_parameters have no lora settings (rank, "
            "alpha) to scale them by. Fix: export a checkpoint HFCausalLM(lora=...) wrote."
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # the mode `mkdir` and `save_pretrained` give (mkdtemp's is 0700: owner only)
    try:
        if adapters:
            _write_adapters(staging, load, lora, adapted, hparams.get("pretrained"))
        else:
            _write_model(staging, ckpt, entries, load, hparams, adapted, lora, source, max_shard_size, tokenizer)
        _move_into(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _write_model(
    staging: Path,
    ckpt: Path,
    entries: dict[str, tuple[tuple[int, ...], torch.dtype]],
    load: Callable[[Iterable[str]], dict[str, torch.Tensor]],
    hparams: dict[str, Any],
    adapted: list[str],
    lora: dict[str, Any] | None,
    source: Any,
    max_shard_size: float,
    tokenizer: str | Path | None,
) -> None:
    """The merged model's weights, `config.json` and tokenizer files, written into `staging`."""
    from transformers import AutoModelForCausalLM

    from parallelkit.models.hf_config import build_config

    config = build_config(source)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    duplicates = {name for group in tied_parameters(skeleton) for name in group[1:]}
    tensors = _merged_tensors(ckpt, entries, load, skeleton, hparams, adapted, lora)
    names = [k for k in tensors.entries if k.startswith(HF_MODULE) and k[len(HF_MODULE) :] not in duplicates]
    _write_weights(staging, names, tensors, max_shard_size)
    config.save_pretrained(staging)
    origin = Path(tokenizer) if tokenizer else Path(hparams["pretrained"]) if hparams.get("pretrained") else None
    for name in TOKENIZER_FILES if origin is not None else ():
        if (origin / name).is_file():
            shutil.copy2(origin / name, staging / name)


EXPORTED_WEIGHTS = re.compile(r"model\.safetensors(\.index\.json)?|model-\d{5}-of-\d{5}\.safetensors")
"""The names of the weight files an export writes: one file, or shards and their index."""


def _move_into(staging: Path, out: Path) -> None:
    """Put a complete export from `staging` at `out`: renamed whole where `out` does not exist; otherwise moved in
    file by file, replacing those of the same name, after removing the weight files of an earlier export that this
    one does not replace (transformers would read a stale `model.safetensors` before a new index)."""
    if not out.exists():
        os.replace(staging, out)
        return
    written = {path.name for path in staging.iterdir()}
    if any(EXPORTED_WEIGHTS.fullmatch(name) for name in written):
        for path in out.iterdir():
            if EXPORTED_WEIGHTS.fullmatch(path.name) and path.name not in written and path.is_file():
                path.unlink()
    for name in sorted(written):
        os.replace(staging / name, out / name)


class _Tensors(NamedTuple):
    """The model's tensors to export, by checkpoint key: `entries` {key: (shape, dtype)}, `load(keys)` -> tensors."""

    entries: dict[str, tuple[tuple[int, ...], torch.dtype]]
    load: Callable[[Iterable[str]], dict[str, torch.Tensor]]


def _merged_tensors(
    ckpt: Path,
    entries: dict[str, tuple[tuple[int, ...], torch.dtype]],
    load: Callable[[Iterable[str]], dict[str, torch.Tensor]],
    skeleton: nn.Module,
    hparams: dict[str, Any],
    adapted: list[str],
    lora: dict[str, Any],
) -> _Tensors:
    """The base model's tensors with each adapter merged in (`W + alpha / rank * B @ A`); the base weights a LoRA
    checkpoint does not hold are read from the pretrained directory it was trained from."""
    if not adapted:
        return _Tensors(entries, load)
    wanted = [HF_MODULE + name for name in skeleton.state_dict()]
    absent = [k for k in wanted if k not in entries]
    pretrained = SafetensorsWeights(hparams["pretrained"]) if absent and hparams.get("pretrained") else None
    if absent and (pretrained is None or any(k[len(HF_MODULE) :] not in pretrained.files for k in absent)):
        raise CheckpointError(
            f"{ckpt} holds LoRA adapters only, and its base weights ({absent[0]}, ...) "
            + (
                f"are not in the pretrained directory {hparams['pretrained']} it names."
                if hparams.get("pretrained")
                else "came from the seed, not from a pretrained directory, so they cannot be read back."
            )
            + " Fix: export the adapters alone with --adapters, or train from model.init_args.pretrained."
        )
    merged = {k: entries[k] for k in wanted if k in entries}
    for key in absent:
        name = key[len(HF_MODULE) :]
        merged[key] = (pretrained.shape(name), pretrained.entries[name][1])
    scaling = lora["alpha"] / lora["rank"]
    factors = load([f"{module}.{part}" for module in adapted for part in ("lora_A", "lora_B")])  # small: read once

    def load_merged(keys: Iterable[str]) -> dict[str, torch.Tensor]:
        keys = list(keys)
        out = load([k for k in keys if k in entries])
        for key in keys:
            if key not in out:
                name = key[len(HF_MODULE) :]
                out[key] = pretrained.read(name, tuple(slice(0, n) for n in pretrained.shape(name)))
        for module in adapted:
            if f"{module}.weight" in out:
                a, b = factors[f"{module}.lora_A"], factors[f"{module}.lora_B"]
                weight = out[f"{module}.weight"]
                out[f"{module}.weight"] = (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)
        return out

    return _Tensors(merged, load_merged)


def _write_weights(staging: Path, names: list[str], tensors: _Tensors, max_shard_size: float) -> None:
    from safetensors.torch import save_file

    shards = _plan_shards(names, tensors.entries, max_shard_size)
    weight_map, total = {}, 0
    for index, keys in enumerate(shards):
        file = WEIGHTS if len(shards) == 1 else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        shard = {k[len(HF_MODULE) :]: v.contiguous() for k, v in tensors.load(keys).items()}
        save_file(shard, staging / file, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(shard, file))
        del shard
    if len(shards) > 1:
        index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / INDEX).write_text(json.dumps(index_file, indent=2, sort_keys=True) + "\n")


PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
"""Where a `peft.PeftModel` holds the transformers model: its adapter keys are `<prefix><module>.lora_A.weight`."""


def _write_adapters(
    staging: Path,
    load: Callable[[Iterable[str]], dict[str, torch.Tensor]],
    lora: dict[str, Any],
    adapted: list[str],
    pretrained: str | None,
) -> None:
    """The adapters as `PeftModel.save_pretrained` writes LoRA ones: safetensors keyed by PEFT's names, and a config
    naming every adapted module exactly (PEFT matches a listed name in full)."""
    from safetensors.torch import save_file

    keys = [f"{module}.{part}" for module in adapted for part in ("lora_A", "lora_B")]
    tensors = {PEFT_PREFIX + k[len(HF_MODULE) :] + ".weight": v.contiguous() for k, v in load(keys).items()}
    save_file(tensors, staging / PEFT_WEIGHTS, metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": pretrained,
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "target_modules": [module[len(HF_MODULE) :] for module in adapted],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (staging / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def _plan_shards(
    names: list[str], entries: dict[str, tuple[tuple[int, ...], torch.dtype]], limit: float
) -> list[list[str]]:
    """Consecutive tensors grouped into shards of at most `limit` bytes each."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        shape, dtype = entries[name]
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards
