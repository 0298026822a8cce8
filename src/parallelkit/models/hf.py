"""Any Hugging Face `transformers` causal LM, trained by parallelkit from the model's own parallel plans.

A `transformers` model carries its tensor-parallel plan (`config.base_model_tp_plan` and the head's `_tp_plan`)
and its pipeline pieces (`config.base_model_pp_plan`). `HFCausalLM` translates them into a `ParallelPlan`, adding
what a trainer needs and HF leaves out: sequence parallelism on the residual stream (norms, the embedding's
output), tp divisibility by the query *and* key/value head counts, and pipeline stages that hand each other the
positions as well as the hidden states. `transformers` is an optional extra (`pip install -e ".[hf]"`), imported
only when this class is used; nothing is downloaded: a model is built from a config (random init from the seed).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from parallelkit.compat import hf_initialize, hf_pp_plan, hf_supports_sdpa, hf_tp_plan
from parallelkit.contract import ParallelPlan
from parallelkit.errors import ConfigError, PlanError
from parallelkit.init import building_on_meta, materialize, meta_parameters
from parallelkit.lora import LoRA, add_adapters, as_lora, config_dict, is_adapter, reset_adapters
from parallelkit.models.hf_io import SafetensorsWeights, load_weights
from parallelkit.models.lm import CausalLM

HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",
    "embedding_rowwise": "vocab_embedding",
    "replicated_with_grad_allreduce": "head_norm",
}
"""transformers 5.x tensor-parallel style names -> parallelkit's (`parallelkit.plan.STYLES`). The output
embedding's `colwise_gather_output` becomes `vocab_head` (so loss parallelism can keep its logits sharded)."""

PIPELINE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""Model types whose decoder layers a pipeline stage runs as their base model does (hidden states, rotary
position embeddings, causal attention without a mask). Checked by loss parity for llama and qwen3."""

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


class HFCausalLM(CausalLM):
    """A Hugging Face causal language model (Llama, Qwen, Mistral, Gemma, ...) built from its config, trained on
    `(inputs, targets)` token batches under any parallelkit strategy, by the model's own parallel plan.

    Args:
        config: The architecture: an inline mapping with `model_type` and the config's fields (e.g.
            `{model_type: llama, hidden_size: 64, num_attention_heads: 4, num_key_value_heads: 2, ...}`), or a local
            directory holding `config.json`. Default: `pretrained`'s config.json.
        pretrained: A local directory as `save_pretrained` writes it (config.json and safetensors weights, sharded
            or not). Its weights replace the random initialisation; under `meta_init` each process reads only the
            parts of each tensor it holds. None: weights start from the seed (the model's own initialisation).
        attn_implementation: transformers' attention kernel ("sdpa", "eager", ...). Default: "sdpa" where the family
            runs it, else "eager" (Gemma 2).
        lr: Peak AdamW learning rate, reached after the warmup.
        weight_decay: AdamW weight decay, applied to matrices and embeddings only (not norms).
        betas: AdamW betas.
        warmup_steps: Optimizer steps of linear warmup from 0 to `lr`.
        min_lr_ratio: The cosine decay ends at `lr * min_lr_ratio` on the run's last step.
        lora: Low-rank adapters (`parallelkit.lora.LoRA`: rank, alpha, dropout, targets, e.g. `{rank: 8, targets:
            [q_proj, k_proj, v_proj, o_proj]}`) on the targeted linear layers, every other parameter frozen: the base
            weights (from `pretrained`, or the seed) never change, and checkpoints hold the adapters. None: full
            fine-tuning.
    """

    def __init__(
        self,
        config: dict[str, Any] | str | None = None,
        pretrained: str | None = None,
        attn_implementation: str | None = None,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        lora: LoRA | None = None,
    ) -> None:
        super().__init__()
        lora = config_dict(as_lora(lora))  # plain values in the hyperparameters (and checkpoints)
        self.save_hyperparameters()
        transformers = _transformers()
        if config is None and pretrained is None:
            raise ConfigError(
                "HFCausalLM needs model.init_args.config (a mapping with model_type, or a directory holding "
                "config.json) or model.init_args.pretrained (a directory save_pretrained wrote)."
            )
        self.pretrained_weights = SafetensorsWeights(pretrained) if pretrained is not None else None
        hf_config = build_config(config if config is not None else pretrained)
        if attn_implementation is None:
            attn_implementation = "sdpa" if hf_supports_sdpa(hf_config) else "eager"
        eager = not building_on_meta()
        # Always built without storage, then (unless a strategy will) allocated and initialised exactly as
        # meta_init does after sharding: so the eager build and a meta_init run hold the same weights.
        with meta_parameters():
            try:
                self.model = transformers.AutoModelForCausalLM.from_config(
                    hf_config, attn_implementation=attn_implementation
                )
            except ValueError as err:  # transformers refuses a kernel the family does not run
                raise ConfigError(
                    f"model.attn_implementation={attn_implementation!r} is refused by transformers for "
                    f"{hf_config.model_type}: {' '.join(str(err).split())} Fix: attn_implementation: eager, or leave "
                    "it out (sdpa where the family runs it, else eager)."
                ) from err
        self._plan: ParallelPlan | None = None
        with meta_parameters():
            add_adapters(self, lora)
        if eager:
            materialize(self, torch.device("cpu"), dict(self.named_modules()))

    @property
    def config(self) -> Any:
        """The transformers config."""
        return self.model.config

    @property
    def loads_every_parameter(self) -> bool:
        """Whether `init_weights()` reads every parameter from pretrained weights (it refuses to leave one out):
        `parallelkit.init.materialize` then skips the random draws it would replay for an eager build's weights."""
        return self.pretrained_weights is not None

    @property
    def tokenizer_directory(self) -> str | None:
        """The pretrained directory when it holds a tokenizer (`tokenizer.json`): `TokenizedDataModule`'s default."""
        pretrained = self.hparams.get("pretrained")
        return pretrained if pretrained and (Path(pretrained) / "tokenizer.json").is_file() else None

    @property
    def vocab_size(self) -> int:
        """Token ids the model embeds: `0 .. vocab_size - 1`."""
        return self.config.vocab_size

    @torch.no_grad()
    def init_weights(self) -> None:
        """The pretrained weights this process holds, or else the model's own initialisation (transformers'
        `_init_weights` for every module). Strategies call it after materialising a meta-device model;
        `parallelkit.init` makes a random initialisation layout-independent."""
        if self.pretrained_weights is not None:
            load_weights(self.model, self.pretrained_weights, skip=is_adapter)
        else:
            hf_initialize(self.model)
        reset_adapters(self)  # after transformers' initialisation, which knows nothing of them

    @override
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Positions from the whole sequence: under sequence parallelism the embedding's output (from which
        # transformers would count them) holds only this rank's part of it.
        # The model's own forward, so that what a family does between its decoder stack and the loss (Cohere's
        # logit_scale, Granite's logits_scaling, Gemma's final softcapping) is done as transformers does it.
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        return self.model(input_ids=input_ids, position_ids=positions, use_cache=False).logits

    # -- the parallel plan -----------------------------------------------------------------------------------
    def _names(self) -> dict[str, str]:
        """Module names, relative to this LightningModule, of the pieces the plan refers to."""
        base = f"model.{self.model.base_model_prefix}"
        head = next(name for name, m in self.model.named_modules() if m is self.model.get_output_embeddings())
        embed = next(name for name, m in self.model.named_modules() if m is self.model.get_input_embeddings())
        return {"base": base, "head": f"model.{head}", "embed": f"model.{embed}", "layers": f"{base}.{self._layers()}"}

    def _layers(self) -> str:
        """The name, in the base model, of its decoder layers: the module list its pipeline plan declares, else its
        largest module list (GPT-2's `h`, which declares no plans)."""
        base = self.model.base_model
        lists = {name: m for name, m in base.named_children() if isinstance(m, nn.ModuleList)}
        declared = [name for name in self.config.base_model_pp_plan or {} if name in lists]
        if declared:
            return declared[0]
        if not lists:
            raise PlanError(
                f"{type(base).__name__} ({self.config.model_type}) holds no list of decoder layers (nn.ModuleList) "
                "for parallelkit to shard one by one. Fix: subclass HFCausalLM and override parallel_plan()."
            )
        return max(lists, key=lambda name: sum(p.numel() for p in lists[name].parameters()))

    def parallel_plan(self) -> ParallelPlan:
        """The model's own plans, translated (see the module's docstring). Read once, from the whole model (a
        pipeline stage later drops the layers it does not hold)."""
        if self._plan is None:
            self._plan = self._read_plan()
        return self._plan

    def _read_plan(self) -> ParallelPlan:
        config, names = self.config, self._names()
        description = f"{type(self).__name__} ({config.model_type})"
        tp: dict[str, str] = {}
        untranslated = {}
        for pattern, style in hf_tp_plan(self.model).items():
            if style not in HF_STYLES:
                untranslated[pattern] = style
                continue
            tp[f"model.{pattern}"] = "vocab_head" if f"model.{pattern}" == names["head"] else HF_STYLES[style]
        refusal = ""
        if not any(pattern.startswith(f"{names['layers']}.") for pattern in tp):
            refusal = (
                f"transformers declares no tensor-parallel plan for {config.model_type} (base_model_tp_plan), so "
                "parallelkit cannot tell how its layers split. Fix: train it without a tp axis (e.g. mesh_shape "
                '[[-1], ["fsdp"]]), or give it a plan (subclass HFCausalLM and override parallel_plan()).'
            )
        if untranslated:
            pattern, style = next(iter(untranslated.items()))
            refusal = (
                f"its tensor-parallel plan gives {pattern} the style {style!r}, which parallelkit does not translate; "
                f"it translates {', '.join(HF_STYLES)}. Fix: train it without a tp axis (e.g. mesh_shape [[-1], "
                '["fsdp"]]), or give it a plan (subclass HFCausalLM and override parallel_plan()).'
            )
        tp.setdefault(names["embed"], "vocab_embedding")
        tp.setdefault(names["head"], "vocab_head")
        # The residual stream between blocks is sequence-sharded under sequence parallelism: the norms on it
        # compute on their rank's part (no-ops otherwise).
        layers = self.model.get_submodule(names["layers"].removeprefix("model."))
        for child, module in layers[0].named_children():
            if "norm" in type(module).__name__.lower():
                tp[f"{names['layers']}.*.{child}"] = "sequence_parallel"
        if isinstance(getattr(self.model.base_model, "norm", None), nn.Module):
            tp[f"{names['base']}.norm"] = "sequence_parallel"
        # A decoder layer's attention and MLP feed one input to several column-wise projections (q, k, v; gate,
        # up): gathered once at the module under sequence parallelism, not once per projection.
        in_layer = f"{names['layers']}.*."
        for pattern, style in list(tp.items()):
            module = pattern.rpartition(".")[0]
            if style == "colwise" and module.startswith(in_layer) and "." not in module.removeprefix(in_layer):
                tp.setdefault(module, "gather_input")
        return ParallelPlan(
            tp=tp,
            fsdp_units=[f"{names['layers']}.*"],
            pipeline_layers=self._pipeline_layers(),
            pipeline_refusal=self._pipeline_refusal(),
            tp_refusal=refusal,
            tp_divisors={
                "attention heads (num_attention_heads)": config.num_attention_heads,
                "key/value heads (num_key_value_heads)": getattr(config, "num_key_value_heads", None)
                or config.num_attention_heads,
            },
            loss=self.pipeline_loss,
            stage_forward=self._run_stage,
            stage_modules=[f"{names['base']}.rotary_emb"] if hasattr(self.model.base_model, "rotary_emb") else [],
            flops_per_token=self.flops_per_token,
            description=description,
        )

    def _pipeline_layers(self) -> list[str]:
        layers = []
        for name in hf_pp_plan(self.model):
            module = self.model.get_submodule(name)
            layers.append(f"model.{name}.*" if isinstance(module, nn.ModuleList) else f"model.{name}")
        return layers

    def _pipeline_refusal(self) -> str:
        config = self.config
        if config.model_type not in PIPELINE_FAMILIES:
            return (
                f"pipeline stages run a Hugging Face model's decoder layers one by one, as its base model does; "
                f"parallelkit does this for {', '.join(PIPELINE_FAMILIES)}, not {config.model_type!r} (its forward "
                "may do more between layers). Fix: train it with fsdp_tp."
            )
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            return (
                f"{config.model_type} with sliding_window={config.sliding_window} needs an attention mask per layer, "
                "which pipeline stages do not build. Fix: sliding_window: null in the config, or fsdp_tp."
            )
        return ""

    def _run_stage(self, layers: list[tuple[str, nn.Module]], *args: torch.Tensor) -> Any:
        """One pipeline stage: the first takes token ids; the others take `(hidden states, positions)` and hand
        the same on, recomputing the rotary embeddings from the positions; the last returns logits."""
        base = self.model.base_model
        if layers[0][1] is self.model.get_input_embeddings():
            (input_ids,) = args
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            x = input_ids
        else:
            x, positions = args
        rotary = None
        for _, layer in layers:
            if layer is self.model.get_output_embeddings():
                return layer(x)  # PIPELINE_FAMILIES do nothing to the head's logits
            if isinstance(layer, (nn.Embedding,)) or layer is getattr(base, "norm", None):
                x = layer(x)
                continue
            if rotary is None:
                rotary = base.rotary_emb(x, positions)
            x = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary, use_cache=False)
            x = x[0] if isinstance(x, tuple) else x
        return x, positions

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token of the layers this module holds: 6 per weight of every
        linear layer (the embedding lookup is none), plus 12 x (heads x head_dim) x sequence length per attention
        layer for scores and values."""
        config = self.config
        linear = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        attention = sum(1 for name, _ in self.named_modules() if name.endswith("self_attn"))
        return 6.0 * linear + 12.0 * attention * config.num_attention_heads * head_dim * seq_len
