"""Tensor parallelism: the plan's style names as torch `ParallelStyle`s, applied to a model (or a pipeline stage).

A style is one of `parallelkit.contract.STYLES` or a torch `ParallelStyle` instance, used as given. What a name
becomes depends on sequence and loss parallelism (`tp_style`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from parallelkit.contract import STYLES, TP_STYLE_HOOK
from parallelkit.errors import PlanError
from parallelkit.init import retie, tied_parameters

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

    from parallelkit.parallel.resolve import ResolvedPlan


def apply_tensor_parallel(root: nn.Module, tp_mesh: DeviceMesh, resolved: ResolvedPlan) -> nn.Module:
    """Shard `root` (the model, or a pipeline stage holding its modules under their names) in place over the 1-D
    `tp_mesh` following the resolved plan.

    Frozen parameters stay frozen (a LoRA model's base weights). Tied weights (an input embedding shared with the
    output head) stay tied: torch's styles replace each module's parameters on their own, so the first name's
    sharded parameter is put back under the others. Their styles must shard them alike (vocab_embedding and
    vocab_head both split the vocabulary rows).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tied = tied_parameters(root)
    frozen = [name for name, param in root.named_parameters() if not param.requires_grad]
    parallelize_module(root, tp_mesh, tp_styles(root, resolved))
    for name in frozen:  # torch's SequenceParallel makes new parameters trainable whatever the old ones were
        root.get_parameter(name).requires_grad_(False)
    for first, *others in tied:
        placements = {name: getattr(root.get_parameter(name), "placements", None) for name in (first, *others)}
        if len(set(placements.values())) > 1:
            raise PlanError(
                f"{' and '.join(placements)} are one tied parameter, but the tp plan splits them differently "
                f"({placements}). Fix: give them the styles vocab_embedding and vocab_head, or untie them."
            )
    retie(root, tied)
    return root


def tp_styles(root: nn.Module, resolved: ResolvedPlan) -> dict[str, ParallelStyle]:
    """{module name: torch ParallelStyle} for the modules of `root` the resolved plan splits (None styles left out).

    A module with an `adapt_tp_style` method (`parallelkit.contract.TP_STYLE_HOOK`; LoRA's adapted layers) gets the
    style it returns."""
    from torch.distributed.tensor.parallel import ParallelStyle

    held = dict(root.named_modules())
    styles: dict[str, ParallelStyle] = {}
    for fqn, style in resolved.tp_styles.items():
        if fqn not in held:  # a layer of another pipeline stage
            continue
        if not isinstance(style, ParallelStyle):
            style = tp_style(
                style,
                sequence_parallel=resolved.sequence_parallel,
                loss_parallel=resolved.loss_parallel,
                input_gathered=fqn in resolved.gathered,
            )
        adapt = getattr(held[fqn], TP_STYLE_HOOK, None)
        if style is not None:
            styles[fqn] = adapt(style) if callable(adapt) else style
    return styles


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


def _gather_sequence_style() -> ParallelStyle:
    """A module that computes on the whole sequence, the same on every tp rank (nothing in it is split: a
    mixture-of-experts block, whose router and experts see every token): its sequence-sharded input is all-gathered
    and its output cut back to this rank's part. In backward each rank's gradient is the whole one (every rank
    computed the same), so the gather's backward keeps this rank's part and the cut's gathers the whole."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ParallelStyle

    class _GatherSequence(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            def whole(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
                x, *rest = args
                local = DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)
                return (local.redistribute(device_mesh, [Replicate()]).to_local(), *rest)

            def part(_module: nn.Module, _args: tuple[Any, ...], out: Any) -> Any:
                replicated = DTensor.from_local(out, device_mesh, [Replicate()], run_check=False)
                return replicated.redistribute(device_mesh, [Shard(1)]).to_local()

            module.register_forward_pre_hook(whole)
            module.register_forward_hook(part)
            return module

    return _GatherSequence()


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
        case "gather_sequence":
            return _gather_sequence_style() if sequence_parallel else None
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
