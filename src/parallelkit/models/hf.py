"""Any Hugging Face `transformers` causal LM, trained by parallelkit from the model's own parallel plans.

`HFCausalLM` builds the model from its config (random init from the seed) or a `save_pretrained` directory, runs
its own forward, and counts its FLOPs; its parallel plan is read in `hf_plan` and its pipeline stages run in
`hf_stages`. `transformers` is an optional extra (`pip install -e ".[hf]"`), imported only when this class is used;
nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from parallelkit.adapters.experts import read_peft_adapters
from parallelkit.adapters.lora import (
    LoRA,
    add_adapters,
    as_lora,
    config_dict,
    is_adapter,
    quantize_base,
    quantized_names,
    reset_adapters,
)
from parallelkit.compat import hf_initialize, hf_supports_sdpa
from parallelkit.contract import ParallelPlan
from parallelkit.errors import ConfigError
from parallelkit.init import building_on_meta, materialize, meta_parameters, set_whole
from parallelkit.models.hf_attention import use_split_attention
from parallelkit.models.hf_config import _transformers, build_config
from parallelkit.models.hf_convert import ConvertedWeights
from parallelkit.models.hf_io import SafetensorsWeights, load_weights
from parallelkit.models.hf_plan import HFPlanMixin
from parallelkit.models.hf_stages import HFStagesMixin
from parallelkit.models.lm import CausalLM
from parallelkit.models.preference import Preference, as_preference
from parallelkit.models.preference import config_dict as preference_dict


class HFCausalLM(HFPlanMixin, HFStagesMixin, CausalLM):
    """A Hugging Face causal language model (Llama, Qwen, Mistral, Gemma, ...) built from its config, trained on
    `(inputs, targets)` token batches under any parallelkit strategy, by the model's own parallel plan.

    Args:
        config: The architecture: an inline mapping with `model_type` and the config's fields (e.g.
            `{model_type: llama, hidden_size: 64, num_attention_heads: 4, num_key_value_heads: 2, ...}`), or a local
            directory holding `config.json`. Default: `pretrained`'s config.json. An inline key the family's config
            class does not know (a misspelt field, which transformers would keep unread) is refused.
        pretrained: A local directory as `save_pretrained` writes it (config.json and safetensors weights, sharded
            or not). Its weights replace the random initialisation; under `meta_init` each process reads only the
            parts of each tensor it holds. None: weights start from the seed (the model's own initialisation).
        attn_implementation: transformers' attention kernel ("sdpa", "eager", ...). Default: "sdpa" where the family
            runs it, else "eager" (Gemma 2).
        lr: Peak AdamW learning rate, reached after the warmup.
        weight_decay: AdamW weight decay, applied to matrices and embeddings only (not norms).
        betas: AdamW betas.
        warmup_steps: Optimizer steps of linear warmup from 0 to `lr`.
        min_lr_ratio: The cosine decay reaches `lr * min_lr_ratio` as the run ends (after its last step).
        lora: Low-rank adapters (`parallelkit.adapters.lora.LoRA`: rank, alpha, dropout, targets, e.g. `{rank: 8,
            targets: [q_proj, k_proj, v_proj, o_proj]}`) on the targeted linear layers, every other parameter frozen:
            the base weights (from `pretrained`, or the seed) never change, and checkpoints hold the adapters. None:
            full fine-tuning.
        preference: Preference tuning (`parallelkit.models.preference.Preference`, TRL's names: loss_type, beta,
            label_smoothing, rpo_alpha, simpo_gamma, reference), trained on `parallelkit.data.PreferenceDataModule`
            pairs: DPO's sigmoid loss by default (`{beta: 0.1}`), IPO, robust DPO, or SimPO. The reference is the
            model with its adapters off under `lora`, else a frozen copy the strategy shards as the model. None:
            language modelling (SFT, pretraining).
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
        preference: Preference | None = None,
    ) -> None:
        super().__init__()
        lora = config_dict(as_lora(lora))  # plain values in the hyperparameters (and checkpoints)
        self.preference = as_preference(preference)
        preference = preference_dict(self.preference)
        self.save_hyperparameters()
        transformers = _transformers()
        if config is None and pretrained is None:
            raise ConfigError(
                "HFCausalLM needs model.init_args.config (a mapping with model_type, or a directory holding "
                "config.json) or model.init_args.pretrained (a directory save_pretrained wrote)."
            )
        self.pretrained_weights = SafetensorsWeights(pretrained) if pretrained is not None else None
        hf_config = build_config(config if config is not None else pretrained, known_keys_only=True)
        if attn_implementation is None:
            attn_implementation = "sdpa" if hf_supports_sdpa(hf_config) else "eager"
        eager = not building_on_meta()
        # Always built without storage, then (unless a strategy will) allocated and initialised exactly as
        # meta_init does after sharding: so the eager build and a meta_init run hold the same weights.
        self._constructed: dict[tuple[nn.Module, str], torch.Tensor] = {}
        with meta_parameters(constructed=self._constructed):
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
        self._module_names: dict[str, str] | None = None
        self._aux_loss: torch.Tensor | None = None
        self._converted: ConvertedWeights | None = None
        with meta_parameters():
            add_adapters(self, lora)
        if eager:
            # QLoRA: the base weights to store in 4 bits read one at a time and quantized before anything else is
            # allocated (or, drawn from the seed, quantized once drawn), so the process never holds them in fp32.
            quantize_base(self, self.base_weight)
            materialize(self, torch.device("cpu"), dict(self.named_modules()))
            quantize_base(self)

    @property
    def config(self) -> Any:
        """The transformers config."""
        return self.model.config

    def base_weight(self, name: str, rows: slice | None = None) -> torch.Tensor | None:
        """The pretrained values of parameter `name` (whole, or its `rows`: an experts parameter's experts this rank
        holds; None without `pretrained`): QLoRA quantizes a meta-built base weight from them before it is sharded."""
        if self.pretrained_weights is None:
            return None
        if self._converted is None:
            self._converted = ConvertedWeights(self.pretrained_weights, self.model)
        key = name.removeprefix("model.")
        box = [slice(0, size) for size in self._converted.shape(key)]
        return self._converted.read(key, tuple([rows or box[0], *box[1:]]))

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
            quantized = set(quantized_names(self.model))  # read and quantized already
            weights = ConvertedWeights(self.pretrained_weights, self.model)
            load_weights(self.model, weights, skip=lambda name: is_adapter(name) or name in quantized)
        else:
            for name, param in self.model.named_parameters():  # marks what transformers' initialisation leaves
                if not param.is_meta and not is_adapter(name):  # (the adapters are reset below)
                    param.fill_(float("nan"))
            hf_initialize(self.model)
            self._keep_constructed_values()
        reset_adapters(self)  # after transformers' initialisation, which knows nothing of them
        lora = as_lora(self.hparams.get("lora"))
        if lora is not None and lora.init_from:  # continuing adapters saved in PEFT's format
            read_peft_adapters(lora.init_from, self.model, lora.targets, lora.rank, lora.alpha)

    def _keep_constructed_values(self) -> None:
        """Parameters transformers' `_init_weights` does not set (a learnable activation's scalars, which its
        constructor sets): the values the constructor gave them, as in transformers' own eager build."""
        from torch.distributed.tensor import DTensor

        for module in self.model.modules():
            for name, param in module.named_parameters(recurse=False):
                local = param.to_local() if isinstance(param, DTensor) else param
                if param.is_meta or is_adapter(name) or not local.isnan().any():
                    continue
                value = self._constructed.get((module, name))
                if value is None:
                    raise ConfigError(
                        f"{self.config.model_type}: transformers' initialisation leaves {type(module).__name__}.{name} "
                        f"({tuple(param.shape)}) unset and its constructor's value was not kept, so parallelkit "
                        "cannot initialise it from the seed. Fix: start from pretrained weights (model.pretrained)."
                    )
                set_whole(param, value.to(local.device, local.dtype))

    @override
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # The model's own forward, so that what a family does between its decoder stack and the loss (Cohere's
        # logit_scale, Granite's logits_scaling, Gemma's final softcapping) is done as transformers does it. Positions
        # too are the model's own: under sequence parallelism the embedding's output, from which transformers counts
        # them, still holds the whole sequence (the stream is sharded from the first decoder layer on). Packed
        # examples come with their `position_ids`, from which transformers builds their block-diagonal mask.
        inputs = {"input_ids": input_ids}
        if position_ids is not None:
            inputs["position_ids"] = position_ids
        if not self._router_loss:
            return self.model(**inputs, use_cache=False).logits
        # A mixture-of-experts config asking for its routers' load-balancing loss: the model's own, from this batch.
        output = self.model(**inputs, use_cache=False, output_router_logits=True)
        self._aux_loss = output.aux_loss
        return output.logits

    def route_attention(self) -> None:
        """Context parallelism (`parallelkit.contract.ATTENTION_HOOK`): every attention module of the model calls the
        `attend` context parallelism gave it, through transformers' attention interface (`hf_attention`)."""
        use_split_attention(self.model)

    @property
    def _router_loss(self) -> bool:
        """Whether the config enables the routers' auxiliary loss (transformers' `output_router_logits`)."""
        return bool(getattr(self.config, "output_router_logits", False)) and hasattr(
            self.config, "router_aux_loss_coef"
        )

    @override
    def auxiliary_loss(self) -> torch.Tensor | float:
        """`router_aux_loss_coef` x the load-balancing loss of the last forward, as transformers adds it to the loss
        (0 unless the config sets `output_router_logits`)."""
        aux, self._aux_loss = self._aux_loss, None
        return 0.0 if aux is None else self.config.router_aux_loss_coef * aux

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token of the layers this module holds: 6 per weight of every
        linear layer (transformers' Conv1D, GPT-2's, included; the embedding lookup is none), plus 12 x (heads x
        head_dim) x sequence length per attention layer for scores and values. A mixture-of-experts layer's experts
        count for the share a token goes through (`num_experts_per_tok` of `num_experts`)."""
        config = self.config
        linear = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear) or _is_conv1d(m))
        held = dict(self.named_modules())
        for name in self.parallel_plan().experts:
            experts = held.get(name)
            count = getattr(getattr(experts, "expert_dispatch", experts), "num_experts", None)
            if isinstance(count, int):  # and held: a pipeline rank drops other stages' layers
                routed = getattr(config, "num_experts_per_tok", None) or count
                linear += sum(p.numel() for p in experts.parameters()) * routed / count
        heads = getattr(config, "num_attention_heads", None) or 0
        head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
        attention = sum(1 for name, _ in self.named_modules() if name.rpartition(".")[2] in ("self_attn", "attn"))
        return 6.0 * linear + 12.0 * attention * heads * head_dim * seq_len


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2's linear layers, weights stored transposed)."""
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor)
