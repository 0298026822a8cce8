"""Hugging Face checkpoints out: a parallelkit checkpoint of an `HFCausalLM` written as a `save_pretrained` directory.

A sharded DCP directory or a single file becomes safetensors shards, written one at a time (peak memory about one
shard, no process group, no GPU), with `config.json` and the tokenizer files of the directory the model came from; a
LoRA run's adapters merged into the base weights, or written alone in PEFT's format.
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

from parallelkit.adapters.experts import PEFT_PREFIX, adapted_weight, adapter_keys, peft_names
from parallelkit.adapters.lora import is_adapter
from parallelkit.checkpoint import (
    MODEL_PREFIX,
    CheckpointError,
    check_output,
    check_readable,
    load_in_one_process,
    load_meta,
    read_metadata,
)
from parallelkit.contract import matches_suffix
from parallelkit.errors import ConfigError
from parallelkit.init import tied_parameters
from parallelkit.models.hf_convert import ConvertedWeights
from parallelkit.models.hf_io import INDEX, WEIGHTS, SafetensorsWeights

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
    adapted = sorted({adapted_weight(k) for k in entries if is_adapter(k)})
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
    pretrained = None
    if absent and hparams.get("pretrained"):  # as the model names and shapes them (fused experts, ...)
        pretrained = ConvertedWeights(SafetensorsWeights(hparams["pretrained"]), skeleton)
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
        merged[key] = (pretrained.shape(name), pretrained.dtype(name))
    scaling = lora["alpha"] / lora["rank"]
    factors = load([key for weight in adapted for key in adapter_keys(weight)])  # small: read once

    def load_merged(keys: Iterable[str]) -> dict[str, torch.Tensor]:
        keys = list(keys)
        out = load([k for k in keys if k in entries])
        for key in keys:
            if key not in out:
                name = key[len(HF_MODULE) :]
                out[key] = pretrained.read(name, tuple(slice(0, n) for n in pretrained.shape(name)))
        for weight_key in adapted:
            if weight_key in out:  # a linear layer's [out, in], or experts' [E, out, in]: B @ A expert by expert
                a, b = (factors[key] for key in adapter_keys(weight_key))
                weight = out[weight_key]
                out[weight_key] = (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)
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

    keys = [key for weight in adapted for key in adapter_keys(weight)]
    named = peft_names({k[len(HF_MODULE) :]: v for k, v in load(keys).items()}, lora["targets"])
    tensors = {PEFT_PREFIX + k: v.contiguous() for k, v in named.items()}
    save_file(tensors, staging / PEFT_WEIGHTS, metadata={"format": "pt"})
    modules = [w[len(HF_MODULE) :].removesuffix(".weight") for w in adapted if w.endswith(".weight")]
    stacked = [w[len(HF_MODULE) :] for w in adapted if not w.endswith(".weight")]
    targets = [lora["targets"]] if isinstance(lora["targets"], str) else lora["targets"]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": pretrained,
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "target_modules": modules or None,
        # PEFT wraps an experts module's parameters in this order (the first innermost): the targets' own
        "target_parameters": [t for t in targets if any(matches_suffix(t, name) for name in stacked)] or None,
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
