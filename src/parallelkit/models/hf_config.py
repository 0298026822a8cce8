"""transformers and a model's config: the supported versions, and a config built from a mapping or a local directory
(read as JSON; nothing in it runs). Shared by `HFCausalLM` and the export (`hf_export`)."""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from parallelkit.errors import ConfigError

SUPPORTED_TRANSFORMERS = ">=5.0,<6"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise ConfigError(
            f"parallelkit.models.HFCausalLM needs transformers{SUPPORTED_TRANSFORMERS}, which is not installed. "
            'Fix: pip install -e ".[hf]" (or pip install "parallelkit[hf]").'
        ) from err
    major = int(transformers.__version__.split(".")[0])
    if major != 5:
        raise ConfigError(
            f"transformers {transformers.__version__} is installed; HFCausalLM reads the parallel plans of "
            f'transformers{SUPPORTED_TRANSFORMERS}. Fix: pip install "transformers{SUPPORTED_TRANSFORMERS}".'
        )
    return transformers


def build_config(config: Mapping[str, Any] | str | Path, *, known_keys_only: bool = False) -> Any:
    """A transformers config from an inline mapping with `model_type`, or from a local directory's config.json; the
    same checks and errors for both (a directory's file is untrusted input: read as JSON, no code in it runs).

    `known_keys_only`: refuse an inline mapping's keys that the family's config class does not know
    (`check_known_keys`), as `HFCausalLM` does; a directory's config.json may carry keys of its own."""
    transformers = _transformers()
    directory = None
    if isinstance(config, (str, Path)):
        directory = Path(config)
        source, fix = f"{directory / 'config.json'}", f"Fix the fields in {directory / 'config.json'}"
        options = _config_json(directory, config)
    else:
        source, fix = "model.config", "Fix the sizes in model.init_args.config"
        options = dict(config)
    if "auto_map" in options:
        raise ConfigError(
            f"{source} has auto_map ({', '.join(f'{k}: {v}' for k, v in dict(options['auto_map']).items())}): the "
            "model's code ships in the directory (transformers' trust_remote_code), and parallelkit does not run code "
            "from model directories. Fix: if the architecture is one transformers ships, set model_type to it and "
            "remove auto_map (transformers then builds the model from its own code); otherwise it cannot be trained "
            "here."
        )
    model_type = options.pop("model_type", None)
    if not model_type:
        raise ConfigError(
            f"{source} has no model_type: name the architecture, e.g. {{model_type: llama, hidden_size: 64, "
            "num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256}."
        )
    if model_type not in transformers.CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(transformers.CONFIG_MAPPING.keys()), n=1)
        raise ConfigError(
            f"{source} model_type={model_type!r} is not a model type transformers {transformers.__version__} "
            f"knows.{f' Did you mean {close[0]!r}?' if close else ''} Fix: e.g. llama, qwen3, mistral, gemma3_text."
        )
    if known_keys_only and directory is None:
        check_known_keys(model_type, options)
    try:
        if directory is not None:
            built = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        else:
            built = transformers.AutoConfig.for_model(model_type, **options)
    except Exception as err:  # noqa: BLE001 - transformers validates configs with several exception types
        cause = " ".join(str(err.__cause__ or err).split())
        raise ConfigError(f"{source} is not a valid {model_type} config: {cause} {fix}.") from err
    text = built.get_text_config()
    pad, vocab = getattr(text, "pad_token_id", None), getattr(text, "vocab_size", None)
    if isinstance(pad, int) and isinstance(vocab, int) and not -vocab <= pad < vocab:
        raise ConfigError(
            f"{source} has pad_token_id={pad}, outside its vocabulary of vocab_size={vocab} tokens (the embedding's "
            f"padding row must be one of its rows). {fix}: a pad_token_id below {vocab}, or null."
        )
    return built


def check_known_keys(model_type: str, options: Mapping[str, Any]) -> None:
    """Raise a ConfigError naming each key of `options` (an inline config of `model_type`, without it) that the
    family's config class does not know, and the closest it does: transformers keeps an unknown key as an attribute
    nothing reads, so a misspelt field would leave the model at that field's default without a word.

    Known: the class's fields and constructor arguments, its `attribute_map` aliases, its sub-configs, any attribute
    a default instance has (properties included), an optional key transformers' code reads (`read_keys`: Qwen3-MoE's
    `head_dim`, which is no field of its class), and a key transformers consumes when building (`rope_theta`,
    `rope_scaling`, `torch_dtype`: the legacy keys saved configs carry), found by building with that key alone."""
    transformers = _transformers()
    cls = transformers.CONFIG_MAPPING[model_type]
    try:
        default = cls()
    except Exception:  # noqa: BLE001 - a class that needs arguments: transformers' own checks judge the mapping
        return
    names = {
        name
        for name, param in inspect.signature(cls.__init__).parameters.items()
        if name != "self" and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
    }
    names |= set(default.to_dict()) | set(getattr(cls, "attribute_map", {}) or {})
    names |= set(getattr(cls, "sub_configs", {}) or {})

    def known(key: str) -> bool:
        if key in names:
            return True
        try:
            value = getattr(default, key)
        except AttributeError:
            pass
        else:
            return not callable(value)  # a method's name is no field
        if key in read_keys(model_type):
            return True
        try:
            probe = cls(**{key: options[key]})
        except Exception:  # noqa: BLE001 - transformers read the key and refused its value: it knows it
            return True
        return key not in vars(probe)  # consumed (a legacy key, converted) rather than kept as it came

    unknown = [key for key in options if not known(str(key))]
    if not unknown:
        return
    fields = sorted(name for name in names if not name.startswith("_"))
    said = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), fields, n=1)
        guess = f"did you mean {close[0]!r}, which stays {getattr(default, close[0], None)!r}?" if close else ""
        said.append(f"{key}={options[key]!r}" + (f" ({guess})" if guess else ""))
    it, attribute = ("it", "an attribute") if len(unknown) == 1 else ("them", "attributes")
    listed = "" if all("did you mean" in part for part in said) else f" Its fields: {', '.join(fields)}."
    raise ConfigError(
        f"model.config has {'a key' if len(unknown) == 1 else 'keys'} {cls.__name__} (model_type {model_type}) does "
        f"not know: {'; '.join(said)}. transformers would keep {it} as {attribute} nothing reads and build the model "
        f"without {it}.{listed} Fix: rename or remove {it} in model.init_args.config."
    )


OPTIONAL_READ = re.compile(r"""(?:getattr|hasattr)\(\s*(?:self|[\w.]*config[\w.]*)\s*,\s*["'](\w+)["']""")
"""`getattr(config, "head_dim", ...)` and its kind in transformers' sources: a config key read when present."""

SHARED_SOURCES = (
    "configuration_utils.py",
    "modeling_utils.py",
    "modeling_rope_utils.py",
    "modeling_flash_attention_utils.py",
    "masking_utils.py",
    "cache_utils.py",
    "integrations/*.py",
)
"""transformers' modules, beside a family's own, whose code reads config keys that may be absent."""


@functools.cache
def read_keys(model_type: str) -> frozenset[str]:
    """The config keys transformers' code reads where present (`getattr(config, KEY, default)`, `hasattr`), in the
    family's own modules (`transformers/models/<family>/`) and the shared ones: keys that change the model although
    its config class does not declare them."""
    transformers = _transformers()
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    root = Path(transformers.__file__).parent
    files = [path for pattern in SHARED_SOURCES for path in root.glob(pattern)]
    files += (root / "models" / model_type_to_module_name(model_type)).glob("*.py")
    return frozenset(key for path in files for key in OPTIONAL_READ.findall(path.read_text(encoding="utf-8")))


def _config_json(directory: Path, given: str | Path) -> dict[str, Any]:
    """The mapping in `directory/config.json`, or a ConfigError naming what is wrong with it."""
    path = directory / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model.config={str(given)!r} is not a directory holding config.json (as save_pretrained writes it). "
            "Fix: the path of such a directory, or an inline mapping such as {model_type: llama, hidden_size: "
            "64, ...}. Nothing is downloaded: hub names are not accepted."
        )
    try:
        options = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"{path} is not JSON ({err}): the file is damaged or cut short. Fix: save the model's config again "
            "(config.save_pretrained(DIR)), or copy config.json from the model's original directory."
        ) from None
    if not isinstance(options, dict):
        raise ConfigError(f"{path} holds a JSON {type(options).__name__}, not the config's mapping of fields.")
    return options
