"""transformers and a model's config: the supported versions, and a config built from a mapping or a local directory
(read as JSON; nothing in it runs). Shared by `HFCausalLM` and the export (`hf_export`)."""

from __future__ import annotations

import difflib
import json
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


def build_config(config: Mapping[str, Any] | str | Path) -> Any:
    """A transformers config from an inline mapping with `model_type`, or from a local directory's config.json; the
    same checks and errors for both (a directory's file is untrusted input: read as JSON, no code in it runs)."""
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
