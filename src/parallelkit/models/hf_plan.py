"""The parallel plan of a Hugging Face causal LM, read from the model's own plans: `HFCausalLM`'s plan reading.

A `transformers` model carries its tensor-parallel plan (`config.base_model_tp_plan` and the head's `_tp_plan`)
and its pipeline pieces (`config.base_model_pp_plan`). `HFPlanMixin` translates them into a `ParallelPlan`, adding
what a trainer needs and HF leaves out: sequence parallelism on the residual stream (norms, the embedding's
output), tp divisibility by the query *and* key/value head counts, and pipeline stages that hand each other the
positions as well as the hidden states. What cannot be translated is refused by name, with the fix.
"""

from __future__ import annotations

from torch import nn

from parallelkit.adapters.lora import QUANTIZED_TP_REFUSAL
from parallelkit.compat import hf_ep_plan, hf_pp_plan, hf_tp_plan
from parallelkit.contract import ParallelPlan, matches
from parallelkit.errors import PlanError
from parallelkit.models.hf_families import CP_FAMILIES, PIPELINE_FAMILIES, TP_FAMILIES
from parallelkit.models.hf_router import same_as_family

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


class HFPlanMixin:
    """`HFCausalLM`'s plan: read from its transformers model (`self.model`), once. Kept apart from the model's build
    and forward; it relies on what `HFCausalLM` gives it (`config`, `hparams`, `_router_loss`, `flops_per_token`,
    the stage forward of `HFStagesMixin`)."""

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
            attention=self._attention_modules(),
            attention_refusal=self._attention_refusal(),
            tp_divisors=self._head_counts(),
            loss=self.pipeline_loss,
            auxiliary_loss=self.auxiliary_loss if self._router_loss else None,
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

    def _attention_modules(self) -> list[str]:
        """Globs of the decoder layers' attention modules (a child whose class is an `...Attention`): context
        parallelism routes their attention function to attend across the cp ranks' slices (`hf_attention`)."""
        layers = self.model.get_submodule(self._names()["layers"].removeprefix("model."))
        children = {
            child
            for layer in layers
            for child, module in layer.named_children()
            if type(module).__name__.endswith("Attention")
        }
        return [f"{self._names()['layers']}.*.{child}" for child in sorted(children)]

    def _attention_refusal(self) -> str:
        model_type = self.config.model_type
        if dropout := getattr(self.config, "attention_dropout", 0.0):
            return (
                f"its config sets attention_dropout={dropout}, which parallelkit's attention across cp ranks does not "
                "apply. Fix: attention_dropout: 0.0 in the config, or a mesh without cp."
            )
        if model_type not in CP_FAMILIES:
            return (
                f"with its sequences split over cp ranks (one process holding every rank's slice), {model_type!r} "
                "does not compute its own logits (or its tiny config could not be checked) in parallelkit's family "
                "sweep, tests/test_hf_families.py: its attention cannot be split (docs/families.md, column cp, says "
                'why). Fix: a mesh without cp (e.g. mesh_shape [[-1], ["fsdp"]]).'
            )
        return ""

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
        if self._router_loss and not same_as_family(self.model):
            return (
                f"{model_type}'s config sets output_router_logits, and its load-balancing loss is not the per-expert "
                "sums over layers that parallelkit carries from stage to stage (transformers' "
                "load_balancing_loss_func of Qwen3-MoE, Mixtral, OLMoE, ...), so no stage could compute it. Fix: "
                "output_router_logits: false in the config, or train it without pp (fsdp, ep, tp)."
            )
        if model_type not in PIPELINE_FAMILIES:
            return (
                f"pipeline stages run a Hugging Face model's decoder layers one by one, with what its base model "
                f"hands each; for {model_type!r} two stages do not compute the model's own logits (or its tiny config "
                "could not be checked) in parallelkit's family sweep, tests/test_hf_families.py. Fix: train it with "
                "fsdp_tp."
            )
        return ""


def _within(pattern: str, name: str) -> bool:
    """Whether glob `pattern` names module `name` or something inside it."""
    parts, depth = pattern.split("."), len(name.split("."))
    return len(parts) >= depth and matches(".".join(parts[:depth]), name)
