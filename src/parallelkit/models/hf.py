"""Any Hugging Face `transformers` causal LM, trained by parallelkit from the model's own parallel plans.

A `transformers` model carries its tensor-parallel plan (`config.base_model_tp_plan` and the head's `_tp_plan`)
and its pipeline pieces (`config.base_model_pp_plan`). `HFCausalLM` translates them into a `ParallelPlan`, adding
what a trainer needs and HF leaves out: sequence parallelism on the residual stream (norms, the embedding's
output), tp divisibility by the query *and* key/value head counts, and pipeline stages that hand each other the
positions as well as the hidden states. `transformers` is an optional extra (`pip install -e ".[hf]"`), imported
only when this class is used; nothing is downloaded: a model is built from a config (random init from the seed).

Over 400 lines: `HFCausalLM` is one adapter of one foreign model class (its build, initialisation, weights in,
parallel plans and pipeline stages), and the stage helpers at the end serve only it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from parallelkit.compat import hf_ep_plan, hf_initialize, hf_pp_plan, hf_supports_sdpa, hf_tp_plan
from parallelkit.contract import ParallelPlan, matches
from parallelkit.errors import ConfigError, PlanError
from parallelkit.init import building_on_meta, materialize, meta_parameters, set_whole
from parallelkit.lora import (
    QUANTIZED_TP_REFUSAL,
    LoRA,
    add_adapters,
    as_lora,
    config_dict,
    is_adapter,
    quantize_base,
    reset_adapters,
)
from parallelkit.models.hf_config import _transformers, build_config
from parallelkit.models.hf_convert import ConvertedWeights
from parallelkit.models.hf_families import PIPELINE_FAMILIES, TP_FAMILIES
from parallelkit.models.hf_io import SafetensorsWeights, load_weights
from parallelkit.models.lm import CausalLM

HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "rowwise_split_input": "rowwise_split_input",
    "colwise_gather_output": "colwise_gather",
    "embedding_rowwise": "vocab_embedding",
    "replicated_with_grad_allreduce": "head_norm",
}
"""transformers 5.x tensor-parallel style names -> parallelkit's (`parallelkit.contract.STYLES`). The output
embedding's `colwise_gather_output` becomes `vocab_head` (so loss parallelism can keep its logits sharded)."""


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

    def base_weight(self, name: str) -> torch.Tensor | None:
        """The pretrained values of parameter `name` (whole; None without `pretrained`): QLoRA quantizes a meta-built
        base weight from them before it is sharded."""
        if self.pretrained_weights is None:
            return None
        if self._converted is None:
            self._converted = ConvertedWeights(self.pretrained_weights, self.model)
        key = name.removeprefix("model.")
        return self._converted.read(key, tuple(slice(0, size) for size in self._converted.shape(key)))

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
            load_weights(self.model, ConvertedWeights(self.pretrained_weights, self.model), skip=is_adapter)
        else:
            for name, param in self.model.named_parameters():  # marks what transformers' initialisation leaves
                if not param.is_meta and not is_adapter(name):  # (the adapters are reset below)
                    param.fill_(float("nan"))
            hf_initialize(self.model)
            self._keep_constructed_values()
        reset_adapters(self)  # after transformers' initialisation, which knows nothing of them

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

    # -- the parallel plan -----------------------------------------------------------------------------------
    def _names(self) -> dict[str, str]:
        """Module names, relative to this LightningModule, of the pieces the plan refers to: read once, from the
        whole model (a pipeline stage later drops the modules it does not hold)."""
        if self._module_names is None:
            named = list(self.model.named_modules())
            base = next(f"model.{name}".rstrip(".") for name, m in named if m is self.model.base_model)
            head = next(name for name, m in named if m is self.model.get_output_embeddings())
            embed = next(name for name, m in named if m is self.model.get_input_embeddings())
            layers = f"{base}.{self._layers()}"
            # The final norm: the pipeline plan's module after the decoder layers (other than the head).
            plan = [f"model.{name}" for name in hf_pp_plan(self.model)]
            after = plan[plan.index(layers) + 1 :] if layers in plan else []
            norm = next((name for name in after if name != f"model.{head}"), "")
            self._module_names = {
                "base": base,
                "head": f"model.{head}",
                "embed": f"model.{embed}",
                "layers": layers,
                "norm": norm,
            }
        return self._module_names

    def _layers(self) -> str:
        """The name, in the base model, of its decoder layers: the module list its pipeline plan declares, else its
        largest module list at any depth (GPT-2's `h`, OPT's `decoder.layers`, which declare no pipeline plan)."""
        base = self.model.base_model
        lists = {name: m for name, m in base.named_modules() if name and isinstance(m, nn.ModuleList)}
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
        experts, experts_refusal = self._experts()
        blocks = sorted({name.rpartition(".")[0] for name in experts})  # the MoE blocks: router, experts, shared
        modules = [f"model.{name}" for name, _ in self.model.named_modules() if name]
        for pattern, style in hf_tp_plan(self.model).items():
            # A MoE block runs whole on every tp rank (gather_sequence below) and its experts divide over ep: a glob
            # reaching into MoE blocks keeps only the modules outside them (the MLPs of dense layers, if any).
            covered = [name for name in modules if matches(f"model.{pattern}", name)]
            outside = [name for name in covered if not any(_within(name, block) for block in blocks)]
            if not outside and any(_within(f"model.{pattern}", block) for block in blocks):
                continue
            if style not in HF_STYLES:
                untranslated[pattern] = style
                continue
            for name in [f"model.{pattern}"] if outside == covered else outside:
                tp[name] = "vocab_head" if name == names["head"] else HF_STYLES[style]
        refusal = ""
        if blocks and not any(pattern.startswith(f"{names['layers']}.") for pattern in tp):
            refusal = (
                f"transformers' tensor-parallel plan for {config.model_type} splits only its experts, which "
                "parallelkit divides over an ep axis instead (expert parallelism): nothing else in its layers is "
                'declared to split. Fix: an ep axis instead of tp (e.g. mesh_shape [[-1, 2], ["fsdp", "ep"]]).'
            )
        elif not any(pattern.startswith(f"{names['layers']}.") for pattern in tp):
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
        if (self.hparams.get("lora") or {}).get("quantize_base"):
            refusal = QUANTIZED_TP_REFUSAL
        if not refusal and config.model_type not in TP_FAMILIES:
            refusal = (
                f"split tp=2 on two processes, {config.model_type} does not compute one process's loss and gradients "
                "(or could not be checked) in parallelkit's family sweep, tests/test_hf_families.py, so parallelkit "
                'does not split it. Fix: train it without a tp axis (e.g. mesh_shape [[-1], ["fsdp"]]).'
            )
        # The embedding's output stays whole: the base model builds attention masks (sliding windows, per-layer
        # types) and position embeddings from it, as on one process. Under sequence parallelism the residual stream
        # is sharded from the first decoder layer on, and its norms compute on their rank's part (no-ops otherwise).
        tp[names["embed"]] = "vocab_embedding_whole"
        tp.setdefault(names["head"], "vocab_head")
        tp[f"{names['layers']}.0"] = "shard_sequence"
        layers = self.model.get_submodule(names["layers"].removeprefix("model."))
        for child, module in layers[0].named_children():
            if "norm" in type(module).__name__.lower():
                tp[f"{names['layers']}.*.{child}"] = "sequence_parallel"
        if names["norm"]:
            tp[names["norm"]] = "sequence_parallel"
        # A decoder layer's attention and MLP feed one input to several column-wise projections (q, k, v; gate,
        # up): gathered once at the module under sequence parallelism, not once per projection. The module then
        # sees the whole sequence too, as it must where it shapes its projections' outputs by its input's (Phi-3).
        for pattern, style in list(tp.items()):
            module = pattern.rpartition(".")[0]
            inside = matches(f"{names['layers']}.*.*", module)  # a module (glob or name) right inside a layer
            if style in ("colwise", "colwise_gather") and inside:
                tp.setdefault(module, "gather_input")
        for block in blocks:  # after the gather_input globs, which a MoE block's name may match too
            tp[block] = "gather_sequence"
        return ParallelPlan(
            tp=tp,
            fsdp_units=[f"{names['layers']}.*"],
            pipeline_layers=self._pipeline_layers(),
            pipeline_refusal=self._pipeline_refusal(),
            tp_refusal=refusal,
            experts=experts,
            experts_refusal=experts_refusal,
            tp_divisors=self._head_counts(),
            loss=self.pipeline_loss,
            stage_forward=self._run_stage,
            stage_modules=self._stage_modules(),
            flops_per_token=self.flops_per_token,
            description=description,
        )

    def _experts(self) -> tuple[list[str], str]:
        """The experts modules transformers' expert-parallel plan names (`ep_dispatch_experts`), and why a family with
        experts but no such plan cannot divide them (empty otherwise: a dense model has no experts to divide)."""
        globs = [f"model.{glob}" for glob, style in hf_ep_plan(self.model).items() if style == "ep_dispatch_experts"]
        named = [f"model.{name}" for name, _ in self.model.named_modules() if name]
        experts = [name for name in named if any(matches(glob, name) for glob in globs)]
        refusal = ""
        if not experts and any(isinstance(getattr(m, "num_experts", None), int) for m in self.model.modules()):
            refusal = (
                f"transformers declares no expert-parallel plan for {self.config.model_type} (base_model_ep_plan), so "
                "parallelkit cannot tell which modules hold its experts. Fix: train it without an ep axis (e.g. "
                'mesh_shape [[-1], ["fsdp"]]), or subclass HFCausalLM and give parallel_plan() its experts.'
            )
        return experts, refusal

    def _pipeline_layers(self) -> list[str]:
        layers = []
        if self._missing_pipeline_module() is not None:
            return layers  # refused (_pipeline_refusal names the module)
        for name in hf_pp_plan(self.model):
            module = self.model.get_submodule(name)
            layers.append(f"model.{name}.*" if isinstance(module, nn.ModuleList) else f"model.{name}")
        return layers

    def _missing_pipeline_module(self) -> str | None:
        """A module the pipeline plan names that the model does not have (its plan is out of date), or None."""
        for name in hf_pp_plan(self.model):
            try:
                self.model.get_submodule(name)
            except AttributeError:
                return name
        return None

    def _head_counts(self) -> dict[str, int]:
        """The head counts tp must divide (a rank holds whole heads); none for a family without attention heads."""
        heads = getattr(self.config, "num_attention_heads", None)
        if not isinstance(heads, int):
            return {}
        return {
            "attention heads (num_attention_heads)": heads,
            "key/value heads (num_key_value_heads)": getattr(self.config, "num_key_value_heads", None) or heads,
        }

    def _stage_modules(self) -> list[str]:
        """The base model's modules outside its pipeline layers that hold no parameters (rotary-embedding tables):
        every stage holds them, for the base model's forward that reads what each layer is handed."""
        base, names = self.model.base_model, self._names()
        layers = {f"model.{name}" for name in hf_pp_plan(self.model)}
        return [
            f"{names['base']}.{child}"
            for child, module in base.named_children()
            if f"{names['base']}.{child}" not in layers and not any(True for _ in module.parameters())
        ]

    def _pipeline_refusal(self) -> str:
        model_type = self.config.model_type
        if not hf_pp_plan(self.model):
            return (
                f"transformers declares no pipeline plan for {model_type} (base_model_pp_plan: its modules in order), "
                "so parallelkit cannot tell where its stages may be cut. Fix: train it with fsdp_tp."
            )
        if (missing := self._missing_pipeline_module()) is not None:
            return (
                f"transformers' pipeline plan for {model_type} names {missing}, which the model does not have. Fix: "
                "train it with fsdp_tp."
            )
        if self._router_loss:
            return (
                f"{model_type}'s config sets output_router_logits: its load-balancing loss is computed from every "
                "layer's router logits together, which no one pipeline stage holds. Fix: output_router_logits: false "
                "in the config, or train it without pp (fsdp, ep, tp)."
            )
        if model_type not in PIPELINE_FAMILIES:
            return (
                f"pipeline stages run a Hugging Face model's decoder layers one by one, with what its base model "
                f"hands each; for {model_type!r} two stages do not compute the model's own logits (or its tiny config "
                "could not be checked) in parallelkit's family sweep, tests/test_hf_families.py. Fix: train it with "
                "fsdp_tp."
            )
        return ""

    def _run_stage(self, layers: list[tuple[str, nn.Module]], *args: torch.Tensor) -> Any:
        """One pipeline stage: the first takes token ids (and, for packed examples, their positions); the others take
        `(hidden states, positions)` and hand the same on; the last returns logits. Positions are the sequence's
        (1-D) unless packed examples gave them per row (2-D): those are handed to the model, whose masks they shape.

        Everything between the layers is the model's own code: the base model's forward runs with its decoder
        layers replaced by recorders, so each layer is called with exactly what the base model hands it (masks per
        layer type, rotary tables, positions; on the first stage, the embedding as the base model scales it), and
        the head runs in the model's own forward on the last stage's hidden states (Cohere's scale, Gemma's
        capping)."""
        names = self._names()
        first = layers[0][0] == names["embed"]
        decoders = [(index, module) for name, module in layers if (index := self._decoder_index(name)) is not None]
        if first:
            input_ids, *given = args
            positions = given[0] if given else torch.arange(input_ids.shape[1], device=input_ids.device)
            inputs = {"input_ids": input_ids, **_packed(positions)}
            calls = self._layer_calls({0, *(i for i, _ in decoders)}, inputs)
            x = _hidden_states(*calls[0])  # the embedding's output as the base model hands it to layer 0
        else:
            x, positions = args
            whole = (x.shape[0], positions.shape[-1], *x.shape[2:])  # the whole sequence (sequence parallelism)
            inputs = {"inputs_embeds": x.new_zeros(whole), **_packed(positions)}
            calls = self._layer_calls({i for i, _ in decoders}, inputs)
        for index, layer in decoders:
            x = _run_layer(layer, x, *calls[index])
        held = {name for name, _ in layers}
        if names["norm"] in held:
            x = self.model.get_submodule(names["norm"].removeprefix("model."))(x)
        if names["head"] in held:
            return self._logits(x)
        return x, positions

    def _decoder_index(self, name: str) -> int | None:
        """The index of decoder layer `name` (`model.model.layers.3` -> 3), or None for another module."""
        rest = name.removeprefix(f"{self._names()['layers']}.")
        return int(rest) if rest != name and rest.isdigit() else None

    def _layer_calls(
        self, wanted: set[int], inputs: dict[str, torch.Tensor]
    ) -> dict[int, tuple[tuple[Any, ...], dict[str, Any]]]:
        """`{index: (args, kwargs)}`: what the base model's forward hands each decoder layer in `wanted`. It runs
        with its decoder layers replaced by recorders and the modules this stage does not hold, and the final norm,
        by identities, and stops at the last wanted layer. Stages after the first run it on zeros the shape of
        the whole sequence's hidden states: masks and position tables depend on shapes and positions alone."""
        base, names = self.model.base_model, self._names()
        calls: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        last = max(wanted, default=-1)
        count = len(self.model.get_submodule(names["layers"].removeprefix("model.")))
        recorders = nn.ModuleList(_Recorder(i, calls, stop=i == last) for i in range(count))
        swapped: dict[str, nn.Module] = {names["layers"]: recorders}
        for child, module in base.named_children():
            if module is None or f"{names['base']}.{child}" == names["norm"]:
                swapped[f"{names['base']}.{child}"] = nn.Identity()
        saved = {name: self.get_submodule(name) if self._holds(name) else None for name in swapped}
        try:
            for name, module in swapped.items():
                self._put(name, module)
            base(**inputs, use_cache=False)  # positions counted by the model itself, as in its own forward
        except _Recorded:
            pass
        finally:
            for name, module in saved.items():
                self._put(name, module)
        return calls

    def _holds(self, name: str) -> bool:
        """Whether module `name` is here (a pipeline split empties the slots of layers other stages hold)."""
        parent, _, leaf = name.rpartition(".")
        return getattr(self.get_submodule(parent), leaf, None) is not None

    def _put(self, name: str, module: nn.Module | None) -> None:
        """Put `module` (or None) in the slot `name`, for the stand-ins a stage runs the model's own forward with."""
        parent, _, leaf = name.rpartition(".")
        self.get_submodule(parent).register_module(leaf, module)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits from the last hidden states, through the model's own forward (its base model replaced
        by one that returns them), so a family's post-processing is transformers' own."""
        name = self._names()["base"]
        base = self.get_submodule(name)
        self._put(name, _Returns(_LastHidden(hidden)))
        try:
            ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
            return self.model(input_ids=ids, use_cache=False).logits
        finally:
            self._put(name, base)

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


def _within(pattern: str, name: str) -> bool:
    """Whether glob `pattern` names module `name` or something inside it."""
    parts, depth = pattern.split("."), len(name.split("."))
    return len(parts) >= depth and matches(".".join(parts[:depth]), name)


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' `Conv1D` (GPT-2's linear layers, weights stored transposed)."""
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor)


class _Recorded(Exception):
    """Raised by the last recorder a pipeline stage needs: the rest of the base model's forward is not run."""


class _Recorder(nn.Module):
    """Stands in for decoder layer `index` while a stage reads what the base model hands its layers."""

    def __init__(self, index: int, calls: dict[int, Any], stop: bool) -> None:
        super().__init__()
        self.index, self.calls, self.stop = index, calls, stop

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.calls[self.index] = (args, kwargs)
        if self.stop:
            raise _Recorded
        return _hidden_states(args, kwargs)


class _LastHidden:
    """What the last stage's stand-in base model returns: the hidden states, and None for anything else a model's
    forward reads of its base model's output (an MoE model's router logits)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getattr__(self, name: str) -> None:  # only for attributes it does not have
        return None

    def __getitem__(self, index: int) -> Any:
        return (self.last_hidden_state,)[index]


class _Returns(nn.Module):
    """Stands in for the base model on the last stage: returns the hidden states it was given."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


def _packed(positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's `position_ids` argument for a stage: packed examples' positions (2-D, per row) are passed; the
    sequence's own (1-D) are left to the model to count, as its forward does."""
    return {"position_ids": positions} if positions.ndim == 2 else {}


def _hidden_states(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The hidden states in a recorded decoder-layer call: the first positional argument, or `hidden_states=`."""
    return args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values())))


def _run_layer(layer: nn.Module, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """Call a decoder layer as the base model did, on hidden states `x` in place of the recorded ones."""
    if args:
        out = layer(x, *args[1:], **kwargs)
    else:
        key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
        out = layer(**{**kwargs, key: x})
    return out[0] if isinstance(out, tuple) else out
