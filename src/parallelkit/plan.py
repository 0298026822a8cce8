"""How a model's `ParallelPlan` (`parallelkit.contract`) becomes a parallel model: tensor parallel styles, FSDP
units, activation checkpointing and pipeline stages, applied in one fixed order.

Patterns are module FQNs where `*` (and any fnmatch pattern) stands for exactly one path segment. A style is
one of `STYLES` or a torch `ParallelStyle` instance, used as given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

from torch import nn

from parallelkit.compat import composable_checkpoint
from parallelkit.contract import ParallelPlan, parallel_plan
from parallelkit.errors import PlanError
from parallelkit.init import retie, tied_parameters

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

STYLES = (
    "gather_input",
    "colwise",
    "rowwise",
    "rowwise_split_input",
    "colwise_gather",
    "sequence_parallel",
    "shard_sequence",
    "vocab_embedding",
    "vocab_embedding_whole",
    "vocab_head",
    "head_norm",
    "replicate",
)
"""Style names a `tp_plan` may use; what each becomes depends on sequence/loss parallelism (`tp_style`)."""

SHARDING_STYLES = (
    "colwise",
    "rowwise",
    "rowwise_split_input",
    "colwise_gather",
    "vocab_embedding",
    "vocab_embedding_whole",
    "vocab_head",
)
"""Styles that split a module's weights over the tp group (each rank holds 1 / tp of them)."""

GATHERING_STYLES = ("gather_input", "colwise", "colwise_gather", "vocab_head")
"""Styles whose input sequence parallelism all-gathers (and autograd then keeps whole); the other sharding styles
reduce-scatter (or all-reduce) their output. A column-wise layer inside a `gather_input` module takes the input
that module gathered (`gathered_inside`): one all-gather serves them all."""


def matches(pattern: str, fqn: str) -> bool:
    """True when `fqn` matches `pattern` segment by segment (`*` never crosses a dot)."""
    parts, names = pattern.split("."), fqn.split(".")
    return len(parts) == len(names) and all(fnmatchcase(n, p) for p, n in zip(parts, names))


def select(model: nn.Module, patterns: Iterable[str], field: str) -> list[tuple[str, nn.Module]]:
    """Modules whose FQN matches one of `patterns`, in module order; a pattern matching nothing is an error."""
    patterns = list(patterns)
    named = [(fqn, module) for fqn, module in model.named_modules() if fqn]
    for pattern in patterns:
        if not any(matches(pattern, fqn) for fqn, _ in named):
            top = ", ".join(fqn for fqn, _ in named if "." not in fqn)
            raise PlanError(
                f"{type(model).__name__}.{field} entry {pattern!r} matches no module. Patterns are module "
                f"names with '*' for one path segment (e.g. 'blocks.*.attn.q'); the top-level modules are: "
                f"{top}."
            )
    return [(fqn, module) for fqn, module in named if any(matches(p, fqn) for p in patterns)]


def _replicate_style() -> ParallelStyle:
    """Parameters become Replicate DTensors on the tp mesh; inputs/outputs stay plain tensors.

    Useful for modules outside the split whose parameters should still be DTensors on the tp mesh (so
    every gradient in a tp group is the same kind of tensor).
    """
    from torch.distributed.tensor import DTensor, Replicate, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle

    class _Replicate(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            def wrap_inputs(_module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
                return tuple(
                    DTensor.from_local(x, mesh, [Replicate()], run_check=False) if _plain_tensor(x) else x
                    for x in inputs
                )

            def unwrap_outputs(_module: nn.Module, outputs: Any, _mesh: DeviceMesh) -> Any:
                return outputs.to_local() if isinstance(outputs, DTensor) else outputs

            return distribute_module(module, device_mesh, input_fn=wrap_inputs, output_fn=unwrap_outputs)

    return _Replicate()


def _input_hook(change: Callable[[Any, DeviceMesh], Any]) -> ParallelStyle:
    """A style that changes a module's input with `change(x, mesh)` before its forward, and nothing else.

    The input is the first positional tensor, or else the keyword argument named as the module's `forward`'s first
    parameter (transformers calls attention with `hidden_states=...`).
    """
    import inspect

    import torch
    from torch.distributed.tensor.parallel import ParallelStyle

    class _InputHook(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            first = next(iter(inspect.signature(module.forward).parameters), None)

            def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                index = next((i for i, x in enumerate(args) if isinstance(x, torch.Tensor)), None)
                if index is not None:
                    args = (*args[:index], change(args[index], device_mesh), *args[index + 1 :])
                elif first in kwargs:
                    kwargs = {**kwargs, first: change(kwargs[first], device_mesh)}
                return args, kwargs

            module.register_forward_pre_hook(hook, with_kwargs=True)
            return module

    return _InputHook()


def _gather_input_style() -> ParallelStyle:
    """All-gather a module's sequence-sharded input once, for the column-wise layers inside it to share.

    The input reaches the module as this rank's local part of a Shard(1) stream and leaves the hook as a Replicate
    DTensor: the column-wise layers take it as it is, and in backward their partial input gradients add up into one
    reduce-scatter.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def gathered(x: Any, mesh: DeviceMesh) -> Any:
        if _plain_tensor(x):  # this rank's part of the stream (a sequence-parallel norm may hand a DTensor)
            x = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return x.redistribute(mesh, [Replicate()]) if isinstance(x, DTensor) else x

    return _input_hook(gathered)


def _shard_sequence_style() -> ParallelStyle:
    """Where the sequence-sharded stream begins: the module's input is the whole sequence (the same on every tp
    rank) and it computes on this rank's part of it (no communication; backward all-gathers the gradient).

    For models that derive attention masks, positions or other per-token inputs from the embedding's output before
    their first block (transformers' models): they see the whole sequence, as on one process.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def sharded(x: Any, mesh: DeviceMesh) -> Any:
        if _plain_tensor(x):
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return x.redistribute(mesh, [Shard(1)]).to_local() if isinstance(x, DTensor) else x

    return _input_hook(sharded)


def _colwise_gathered(input_layouts: Any) -> ParallelStyle:
    """Column-wise, its output gathered whole on every rank and laid out contiguously: a gather on the last dim
    leaves it strided, and models slice and `view` it (Phi-3's fused qkv_proj and gate_up_proj)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    class _ColwiseGathered(ColwiseParallel):  # still column-wise to LoRA's adapted_style
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            module = super()._apply(module, device_mesh)
            module.register_forward_hook(lambda _module, _args, output: output.contiguous())
            return module

    return _ColwiseGathered(input_layouts=input_layouts, output_layouts=Replicate())


def _plain_tensor(x: Any) -> bool:
    import torch
    from torch.distributed.tensor import DTensor

    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)


def tp_style(
    name: str, *, sequence_parallel: bool, loss_parallel: bool, input_gathered: bool = False
) -> ParallelStyle | None:
    """The torch ParallelStyle for a style name; None means "leave the module as it is".

    With sequence parallelism the residual stream between blocks is sharded on the sequence dim (Shard(1)):
    embeddings and row-wise outputs produce it, norms compute on it, column-wise inputs gather it, each on its own
    or, `input_gathered`, once for all of them in the `gather_input` module around them.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    stream = Shard(1) if sequence_parallel else Replicate()
    source = Replicate() if input_gathered else stream  # what a column-wise layer is handed
    match name:
        case "gather_input":
            return _gather_input_style() if sequence_parallel else None
        case "shard_sequence":
            return _shard_sequence_style() if sequence_parallel else None
        case "colwise":
            return ColwiseParallel(input_layouts=source)
        case "rowwise":
            return RowwiseParallel(output_layouts=stream)
        case "rowwise_split_input":  # its input is whole on every rank (after a colwise_gather): each takes its part
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
        case "colwise_gather":
            return _colwise_gathered(input_layouts=source)
        case "head_norm":
            # A norm over each head's channels (Qwen3's q_norm/k_norm) after a column-wise projection: its input,
            # (batch, seq, heads, head_dim), holds this rank's heads. Seen as a DTensor sharded on the heads dim,
            # the replicated weight's gradient is a partial sum that DTensor all-reduces over the tp group.
            return SequenceParallel(sequence_dim=2, use_local_output=True)
        case "sequence_parallel":
            # Without sequence parallelism a norm sees the whole sequence on every tp rank: nothing to do. Its
            # output is this rank's part as a plain tensor, as the residual stream is: a norm after a row-wise
            # layer (Gemma's post-norms) feeds the residual sum.
            return SequenceParallel(use_local_output=True) if sequence_parallel else None
        case "vocab_embedding":
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
        case "vocab_embedding_whole":  # the stream is sharded later, where a module says shard_sequence
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        case "vocab_head":
            # Loss parallelism keeps logits sharded on the vocab dim into the cross-entropy.
            return ColwiseParallel(
                input_layouts=stream,
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            )
        case "replicate":
            return _replicate_style()
    raise PlanError(f"unknown tp_plan style {name!r}; use one of {', '.join(STYLES)} or a torch ParallelStyle.")


def _check_divisible(model: nn.Module, fqn: str, module: nn.Module, style: str, tp: int) -> None:
    dims: dict[str, int] = {}
    if isinstance(module, nn.Linear):
        dims = {"in_features": module.in_features} if style in ("rowwise", "rowwise_split_input") else {}
        if style in ("colwise", "vocab_head"):
            dims = {"out_features": module.out_features}
    elif isinstance(module, nn.Embedding) and style in ("vocab_embedding", "vocab_embedding_whole"):
        dims = {"num_embeddings": module.num_embeddings}
    for dim, size in dims.items():
        if size % tp:
            raise PlanError(
                f"{type(model).__name__}.{fqn} ({style}) has {dim}={size}, which tp={tp} does not divide. "
                f"Fix: choose a tp that divides {size}, or resize the model."
            )


def tensor_parallel_plan(
    model: nn.Module,
    tp: int,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    contract: ParallelPlan | None = None,
) -> dict[str, ParallelStyle]:
    """Expand the model's tp globs into {module FQN: ParallelStyle}, checking sizes and head counts against `tp`."""
    from torch.distributed.tensor.parallel import ParallelStyle

    contract = contract or parallel_plan(model)
    if contract.tp_refusal:
        raise PlanError(f"{contract.description}: {contract.tp_refusal}")
    declared: Mapping[str, Any] = contract.tp
    if not declared:
        raise PlanError(
            f"tensor parallelism (tp={tp}) needs {contract.description}.tp_plan: a dict from module name "
            "globs to styles, e.g. {'blocks.*.attn.q': 'colwise', 'blocks.*.attn.proj': 'rowwise'}. "
            f"Styles: {', '.join(STYLES)}. Or use a mesh without a tp axis."
        )
    from parallelkit.lora import LoRALinear, adapted_style

    plan: dict[str, ParallelStyle] = {}
    gathering = gathered_inside(model, contract)
    for pattern, style in declared.items():
        for fqn, module in select(model, [pattern], "tp_plan"):
            if isinstance(style, ParallelStyle):
                resolved = style
            else:
                _check_divisible(model, fqn, module, style, tp)
                resolved = tp_style(
                    style,
                    sequence_parallel=sequence_parallel,
                    loss_parallel=loss_parallel,
                    input_gathered=fqn in gathering,
                )
            if resolved is not None:
                # A layer with LoRA adapters: they are split as the layer is (no collective of their own).
                plan[fqn] = adapted_style(resolved) if isinstance(module, LoRALinear) else resolved
    _check_divisors(contract, tp)  # after the sizes of split weights, which name the module
    return plan


def gathered_inside(model: nn.Module, contract: ParallelPlan) -> dict[str, str]:
    """{column-wise layer: the `gather_input` module around it}: the layers whose input their module gathers."""
    modules = {
        fqn: style
        for pattern, style in contract.tp.items()
        if isinstance(style, str)
        for fqn, _ in select(model, [pattern], "tp_plan")
    }
    gathers = [fqn for fqn, style in modules.items() if style == "gather_input"]
    inside = {}
    for fqn, style in modules.items():
        around = [g for g in gathers if fqn.startswith(f"{g}.")]
        if around and style in GATHERING_STYLES:
            inside[fqn] = around[0]
    return inside


def _check_divisors(contract: ParallelPlan, tp: int) -> None:
    """Every count the plan says tp must divide (head counts: a rank must hold whole heads)."""
    for what, count in contract.tp_divisors.items():
        if count % tp:
            fits = [d for d in range(1, count + 1) if count % d == 0]
            fewer = max(d for d in fits if tp % d == 0)  # keeps the world size: fsdp grows by tp / fewer
            raise PlanError(
                f"{contract.description} has {count} {what}, which tp={tp} does not divide: a tensor-parallel rank "
                f"must hold whole heads. Fix: a tp that divides {count} ({', '.join(map(str, fits))}), e.g. "
                f'mesh_shape [[-1, {fewer}], ["fsdp", "tp"]].'
            )


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    contract: ParallelPlan | None = None,
) -> nn.Module:
    """Shard `model` in place over the 1-D `tp_mesh` following its plan.

    Frozen parameters stay frozen (a LoRA model's base weights). Tied weights (an input embedding shared with the
    output head) stay tied: torch's styles replace each module's parameters on their own, so the first name's
    sharded parameter is put back under the others. Their styles must shard them alike (vocab_embedding and
    vocab_head both split the vocabulary rows).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tied = tied_parameters(model)
    frozen = [name for name, param in model.named_parameters() if not param.requires_grad]
    plan = tensor_parallel_plan(
        model, tp_mesh.size(), sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, contract=contract
    )
    parallelize_module(model, tp_mesh, plan)
    for name in frozen:  # torch's SequenceParallel makes new parameters trainable whatever the old ones were
        model.get_parameter(name).requires_grad_(False)
    for first, *others in tied:
        placements = {name: getattr(model.get_parameter(name), "placements", None) for name in (first, *others)}
        if len(set(placements.values())) > 1:
            raise PlanError(
                f"{' and '.join(placements)} are one tied parameter, but the tp plan splits them differently "
                f"({placements}). Fix: give them the styles vocab_embedding and vocab_head, or untie them."
            )
    retie(model, tied)
    return model


def fsdp_units(model: nn.Module, contract: ParallelPlan | None = None) -> list[tuple[str, nn.Module]]:
    """The modules to shard as their own FSDP groups (the root is wrapped separately, last).

    From the plan's `fsdp_units` globs when declared; otherwise each child of the model's largest `nn.ModuleList`
    (the transformer blocks in most models).
    """
    declared = (contract or parallel_plan(model)).fsdp_units
    if declared is not None:
        return select(model, declared, "fsdp_units")
    lists = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    fqn, largest = max(lists, key=lambda item: len(item[1]))
    return [(f"{fqn}.{name}", child) for name, child in largest.named_children()]


Unit = nn.Module | list[nn.Module]
"""An fsdp unit as FSDP2 takes it: a module, or a list of modules sharded (and gathered) as one group."""


def has_forward(module: nn.Module) -> bool:
    """False for containers such as `nn.ModuleDict`/`nn.ModuleList`, which are never called: hooks on them never run."""
    return type(module).forward is not nn.Module.forward


def runnable_unit(model: nn.Module, fqn: str, module: nn.Module) -> Unit:
    """`module` as an fsdp unit: itself, or for a container without forward (e.g. a block written as an
    `nn.ModuleDict`) its children as one group, since FSDP2 gathers a unit in the forward hooks of its modules."""
    if has_forward(module):
        return module
    children = list(module.named_children())
    uncallable = [name for name, child in children if not has_forward(child)]
    if not children or uncallable:
        inner = f"{fqn}.{uncallable[0]}" if uncallable else fqn
        raise PlanError(
            f"{type(model).__name__}.fsdp_units entry {fqn} ({type(module).__name__}) has no forward(), and "
            f"{'neither does its child ' + inner if uncallable else 'no children to shard in its place'}: FSDP2 "
            "gathers a unit's parameters when the unit is called, and this one never is. Fix: name the modules "
            f"that are called as units instead, e.g. fsdp_units = ['{inner}.*'], or give the block a forward()."
        )
    return [child for _, child in children]


def checkpointed_modules(units: list[Unit], policy: str | int) -> list[nn.Module]:
    """The modules activation checkpointing recomputes in backward: the model's blocks (its fsdp units).

    `policy`: "none", "full" (every block) or an int n (every n-th block: a memory/compute trade-off).
    """
    match policy:
        case "none" | 0:
            return []
        case "full":
            every = 1
        case int() if policy > 0:
            every = policy
        case _:
            raise PlanError(
                f"activation_checkpointing={policy!r}: use 'none', 'full', or a positive int n to checkpoint "
                "every n-th block."
            )
    return [
        module
        for index, unit in enumerate(units)
        if index % every == 0
        for module in (unit if isinstance(unit, list) else [unit])
    ]


def apply_activation_checkpointing(units: list[Unit], policy: str | int) -> None:
    """Recompute activations in backward for the blocks `checkpointed_modules` picks, with torch's composable
    checkpoint, so parameter names (FQNs), and so checkpoints, stay unchanged."""
    for module in checkpointed_modules(units, policy):
        composable_checkpoint(module)


def apply_compile(units: list[Unit], backend: str, checkpointed: Sequence[nn.Module] = ()) -> None:
    """Compile each block's `forward` with `torch.compile(backend=backend)`; those in `checkpointed` recompute their
    activations in backward, by `torch.utils.checkpoint` inside the compiled code.

    Per block, as the field's reference trainers do: blocks repeat, so one compilation serves them all, and the
    embedding, head and loss stay eager. Only `forward` is compiled, not the module's call: the hooks of tensor
    parallel's children run inside the compiled code, while those on the block itself (FSDP's gathers) stay outside
    it, and parameter names, so checkpoints, are those of the eager model. Checkpointing is traced with the block,
    not hooked around it. While saved-tensor hooks are active (e.g. the activation monitors' ledger) the compiled code
    runs under hooks of its own that keep each tensor as it is: torch 2.13's dynamo traces the active hooks and fails
    on FSDP's DTensor parameters; so activation monitors do not see what compiled blocks save for backward. Only then,
    as they cost 3-5% of a block's step on CPU (a run that has both compiles the blocks a second time: dynamo's guards
    check the active hooks).
    """
    import functools

    import torch
    from torch.utils.checkpoint import checkpoint

    from parallelkit.compat import saved_tensors_hooks_active, settle_async_collectives

    def compiled_forward(module: nn.Module) -> Any:
        run = module.forward
        if any(module is m for m in checkpointed):
            run = functools.partial(checkpoint, module.forward, use_reentrant=False)
        compiled = torch.compile(run, backend=backend)

        def forward(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = settle_async_collectives((args, kwargs))
            if not saved_tensors_hooks_active():
                return compiled(*args, **kwargs)
            with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                return compiled(*args, **kwargs)

        return forward

    for unit in units:
        for module in unit if isinstance(unit, list) else [unit]:
            module.forward = compiled_forward(module)


def _keep(tensor: Any) -> Any:
    """A saved-tensor hook that keeps the tensor as it is."""
    return tensor


def apply_fsdp(
    root: nn.Module,
    units: list[Unit],
    dp_mesh: DeviceMesh,
    *,
    param_dtype: Any = None,
    comm_hook: Any = None,
    reshard_after_forward: str = "default",
    cpu_offload: bool = False,
) -> None:
    """fully_shard each fsdp unit, then the root, over `dp_mesh` (2-D replicate x fsdp means HSDP).

    `reshard_after_forward`: "always" frees every gathered weight after its forward, "never" keeps them all,
    "default" frees all but the last unit and the root: backward needs those first, so freeing them would
    only repeat their all-gather at once. `comm_hook` (a `parallelkit.comm.CommHook`) sets the gradient
    reduction dtype and may replace the reduce-scatter of every module it shards.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    options = {
        "mesh": dp_mesh,
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=comm_hook.reduce_dtype if comm_hook is not None else None
        ),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    for index, unit in enumerate(units):
        last = index == len(units) - 1
        reshard = reshard_after_forward == "always" or (reshard_after_forward == "default" and not last)
        fully_shard(unit, reshard_after_forward=reshard, **options)
    # The root holds what no unit does (embeddings, final norm, head).
    fully_shard(root, reshard_after_forward=reshard_after_forward == "always", **options)
    if comm_hook is not None:
        # A group's modules share one FSDP state: configuring its first module configures the group.
        for module in (*units, root):
            comm_hook.configure(module[0] if isinstance(module, list) else module)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    stages: list[list[str]] | None = None,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    activation_checkpointing: str | int = "none",
    compile: str | None = None,
    reshard_after_forward: str = "default",
    param_dtype: Any = None,
    comm_hook: Any = None,
    cpu_offload: bool = False,
) -> list[nn.Module]:
    """Make `model` parallel over `mesh`, in the one fixed order: tensor parallel -> pipeline split ->
    activation checkpointing -> compile -> FSDP. Returns the modules to run: `[model]`, or with `stages` (this
    rank's pipeline stages, as lists of layer names) one `StageModule` per stage, the other layers dropped.

    TP comes first because FSDP shards the DTensors TP made; checkpointing sits inside FSDP units so the
    recompute sees gathered parameters; the compiled blocks see TP's collectives but not FSDP's; each stage is
    its own FSDP root. `compile`: the `torch.compile` backend for each block, or None (eager).
    """
    from parallelkit.mesh import data_parallel_mesh

    contract = parallel_plan(model)
    names = mesh.mesh_dim_names or ()
    if "tp" in names and mesh["tp"].size() > 1:
        apply_tensor_parallel(
            model, mesh["tp"], sequence_parallel=sequence_parallel, loss_parallel=loss_parallel, contract=contract
        )
    units = [(fqn, runnable_unit(model, fqn, unit)) for fqn, unit in fsdp_units(model, contract)]
    if stages is None:
        roots = [(model, [unit for _, unit in units])]
    else:
        kept = {name for stage in stages for name in stage}
        drop_layers(model, [name for name in pipeline_layer_names(model, contract) if name not in kept])
        roots = [
            (
                StageModule(model, stage, contract),
                [u for fqn, u in units if any(_inside(fqn, layer) for layer in stage)],
            )
            for stage in stages
        ]
    dp_mesh = data_parallel_mesh(mesh)
    hsdp = all(axis in names for axis in ("replicate", "fsdp"))
    for root, root_units in roots:
        if compile is None:
            apply_activation_checkpointing(root_units, activation_checkpointing)
        else:
            apply_compile(root_units, compile, checkpointed_modules(root_units, activation_checkpointing))
        if dp_mesh is not None:
            apply_fsdp(
                root,
                root_units,
                mesh["replicate", "fsdp"] if hsdp else dp_mesh,
                param_dtype=param_dtype,
                comm_hook=comm_hook,
                reshard_after_forward=reshard_after_forward,
                cpu_offload=cpu_offload,
            )
    return [root for root, _ in roots]


def _inside(fqn: str, layer: str) -> bool:
    return fqn == layer or fqn.startswith(f"{layer}.")


def pipeline_layer_names(model: nn.Module, contract: ParallelPlan | None = None) -> list[str]:
    """The plan's `pipeline_layers` globs expanded to module names, in execution order.

    Each layer's output feeds the next; every parameter must live in exactly one layer.
    """
    contract = contract or parallel_plan(model)
    if contract.pipeline_refusal:
        raise PlanError(f"{contract.description}: {contract.pipeline_refusal}")
    declared = contract.pipeline_layers
    if not declared:
        raise PlanError(
            f"pipeline parallelism needs {contract.description}.pipeline_layers: module names in execution "
            "order, each layer's output feeding the next, e.g. ['tok_emb', 'blocks.*', 'norm', 'head'], and a "
            "pipeline_loss(output, target) method."
        )
    names = []
    for pattern in declared:
        names += [fqn for fqn, _ in select(model, [pattern], "pipeline_layers") if fqn not in names]
    for name in names:
        if not has_forward(model.get_submodule(name)):
            raise PlanError(
                f"{type(model).__name__}.pipeline_layers entry {name} ({type(model.get_submodule(name)).__name__}) "
                "has no forward(): a pipeline stage calls each layer on the previous one's output. Fix: list the "
                f"modules it holds in execution order instead (e.g. '{name}.*'), or give it a forward()."
            )
    owners: dict[int, str] = {}
    for name in names:
        for param_name, param in model.get_submodule(name).named_parameters():
            if id(param) in owners:
                raise PlanError(
                    f"{contract.description}.{name}.{param_name} is the same tensor as {owners[id(param)]}: tied "
                    "weights cannot be split across pipeline stages. Untie them (e.g. separate embedding and head; "
                    "for a Hugging Face model, tie_word_embeddings: false in its config), or train without pipeline "
                    "parallelism (fsdp_tp)."
                )
            owners[id(param)] = f"{name}.{param_name}"
    outside = [n for n, p in model.named_parameters() if id(p) not in owners]
    if outside:
        raise PlanError(
            f"{type(model).__name__} has parameters outside pipeline_layers: {', '.join(outside[:5])}. Every "
            "parameter must belong to one listed layer; add its module to pipeline_layers."
        )
    return names


def split_stages(
    model: nn.Module, layers: list[str], num_stages: int, split_points: list[int | str] | None = None
) -> list[list[str]]:
    """Cut `layers` into `num_stages` contiguous stages.

    `split_points`: where each stage after the first begins, as layer indices or names. Without them, stages
    are balanced by parameter count (the largest stage as small as possible); the first and last stages,
    which hold the embedding and the head, so get fewer blocks.
    """
    if num_stages > len(layers):
        raise PlanError(
            f"{num_stages} pipeline stages need at least {num_stages} pipeline layers, but "
            f"{type(model).__name__} has {len(layers)} ({', '.join(layers)}). Fix: fewer stages (pp x "
            "stages_per_rank) or a deeper model."
        )
    if split_points is not None:
        starts = [layers.index(p) if isinstance(p, str) and p in layers else p for p in split_points]
        if (
            len(starts) != num_stages - 1
            or any(not isinstance(s, int) for s in starts)
            or starts != sorted(set(starts))
            or not all(0 < s < len(layers) for s in starts)
        ):
            raise PlanError(
                f"split_points={split_points} must name {num_stages - 1} distinct, increasing layer indices "
                f"(1..{len(layers) - 1}) or layer names for {num_stages} stages; layers: {', '.join(layers)}."
            )
    else:
        sizes = [max(sum(p.numel() for p in model.get_submodule(n).parameters()), 1) for n in layers]
        starts = _balanced_starts(sizes, num_stages)
    bounds = [0, *starts, len(layers)]
    return [layers[a:b] for a, b in zip(bounds, bounds[1:])]


def _balanced_starts(sizes: list[int], num_stages: int) -> list[int]:
    """Stage start indices minimising the largest stage's total size (exact, by dynamic programming)."""
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[s][i]: the smallest possible largest load when the first i layers form s stages; cut[s][i]: where
    # the last of those stages starts.
    n = len(sizes)
    best = [[float("inf")] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for stages in range(1, num_stages + 1):
        for end in range(stages, n + 1):
            for start in range(stages - 1, end):
                load = max(best[stages - 1][start], prefix[end] - prefix[start])
                if load < best[stages][end]:
                    best[stages][end], cut[stages][end] = load, start
    starts, end = [], n
    for stages in range(num_stages, 1, -1):
        end = cut[stages][end]
        starts.append(end)
    return sorted(starts)


class StageModule(nn.Module):
    """The layers of one pipeline stage, registered under their original names (`blocks.3` stays `blocks.3`),
    so state dicts, and so checkpoints, are the same whatever the layout. Run as the plan's `stage_forward` says
    (by default, each layer on the previous one's output)."""

    def __init__(self, model: nn.Module, layers: list[str], contract: ParallelPlan | None = None) -> None:
        super().__init__()
        contract = contract or parallel_plan(model)
        for name in [*layers, *contract.stage_modules]:
            if name in contract.stage_modules and any(True for _ in model.get_submodule(name).parameters()):
                raise PlanError(
                    f"{contract.description}: stage module {name} holds parameters; every pipeline stage gets it, "
                    "so it must hold buffers only (list it in pipeline_layers instead)."
                )
            *parents, leaf = name.split(".")
            owner: nn.Module = self
            for part in parents:
                if getattr(owner, part, None) is None:
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            owner.add_module(leaf, model.get_submodule(name))
        self.layer_names = list(layers)
        self._layers = [(name, self.get_submodule(name)) for name in layers]  # a plain list: not registered twice
        self._forward = contract.stage_forward

    def forward(self, *args: Any) -> Any:
        if self._forward is not None:
            return self._forward(self._layers, *args)
        (x,) = args
        for _, layer in self._layers:
            x = layer(x)
        return x


def drop_layers(model: nn.Module, layers: Iterable[str]) -> None:
    """Remove `layers` from `model` in place (their slots become None), keeping every other name unchanged."""
    for name in layers:
        parent, _, leaf = name.rpartition(".")
        (model.get_submodule(parent) if parent else model).register_module(leaf, None)
