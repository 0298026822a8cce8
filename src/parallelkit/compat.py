"""Every private Lightning and torch name parallelkit uses, reached through this module only.

parallelkit hooks into internals that Lightning and torch do not promise to keep. Each use goes through one
function here, so an upgrade that renames or removes one fails in this file; `tests/test_compat.py` lists every
private name below, checks that each still exists with the signature used here, and that no other module reaches
for a private name of its own. Overrides of private methods are listed in `OVERRIDDEN`.

Over 400 lines: its point is to hold every such name in one file, each in a small function of its own.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import ParallelStrategy
    from torch import Tensor
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn import Module

OVERRIDDEN = {
    "lightning.pytorch.strategies.Strategy._configure_launcher": "(self)",
    "lightning.pytorch.cli.LightningCLI._add_configure_optimizers_method_to_model": "(self, subcommand)",
    "lightning.pytorch.callbacks.RichProgressBar._get_train_description": "(self, current_epoch)",
    "lightning.pytorch.strategies.DDPStrategy._register_ddp_hooks": "(self)",
    "torch.distributed.pipelining.stage._PipelineStageBase.perform_reduce_grad": "(self, grad_scale_factor)",
    "torch.distributed.pipelining.stage._PipelineStageBase.get_local_bwd_output": "(self, mb_index)",
    "torch.distributed.pipelining.stage._PipelineStageBase.set_local_bwd_input": (
        "(self, next_stage_bwd_outputs, mb_index)"
    ),
    "torch.distributed.pipelining.stage._PipelineStageBase.forward_one_chunk": (
        "(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True)"
    ),
    "torch.distributed.pipelining.stage._PipelineStageBase.backward_one_chunk": (
        "(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False)"
    ),
    "torch.distributed.pipelining.stage._PipelineStageBase.backward_weight_one_chunk": (
        "(self, bwd_chunk_id, last_backward=False)"
    ),
}
"""Private and internal methods parallelkit's subclasses override (or, for a pipeline stage's `*_one_chunk` actions,
time by wrapping), with the signature they rely on: Lightning's strategies validate their configuration in
`_configure_launcher`, the last hook before workers start; DDPStrategy registers its comm hook in
`_register_ddp_hooks`; torch's pipeline stages reduce gradients in `perform_reduce_grad` and hand input gradients
between stages on one rank through `get_local_bwd_output`/`set_local_bwd_input` (`strategies/pipeline.py`)."""


# -- Lightning ---------------------------------------------------------------------------------------------------
def on_first_registry_read(activate: Callable[[], None]) -> None:
    """Call `activate` (once) when Lightning's StrategyRegistry is first read after now: a Trainer reads it as it is
    built, whatever its `strategy` (so does parallelkit's CLI, checking a strategy name). The registry's class
    (Lightning's private `_StrategyRegistry`) is swapped for a subclass whose readers call `activate` and swap the
    class back: the registry is Lightning's own object throughout, and nothing is imported until a strategy is
    needed."""
    from lightning.pytorch.strategies import StrategyRegistry

    registry_class = type(StrategyRegistry)

    def first(method: str) -> Callable[..., Any]:
        def read(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.__class__ = registry_class
            activate()
            return getattr(self, method)(*args, **kwargs)

        return read

    readers = ("available_strategies", "get", "register", "__contains__", "__getitem__", "__iter__", "keys", "items")
    armed = type("StrategyRegistryBeforeParallelkit", (registry_class,), {name: first(name) for name in readers})
    if registry_class.__name__ != armed.__name__:
        StrategyRegistry.__class__ = armed


def destroy_process_groups_at_exit() -> None:
    """Destroy torch.distributed's process groups when the interpreter exits, whatever the backend.

    Lightning registers its `_destroy_dist_connection` at exit for NCCL only. A gloo group left to the interpreter's
    finalisation can abort a process whose training succeeded ("terminate called without an active exception",
    exit -6): its worker threads are destroyed after Python is gone (pytorch/pytorch#190489). Idempotent.
    """
    from lightning.fabric.utilities.distributed import _destroy_dist_connection

    atexit.unregister(_destroy_dist_connection)
    atexit.register(_destroy_dist_connection)


def setup_distributed(strategy: ParallelStrategy, join_timeout: timedelta | None = None) -> None:
    """Initialise the default process group as Lightning's ModelParallelStrategy does (`_setup_distributed`).
    `join_timeout`: how long the ranks may take to meet, when longer than the strategy's timeout (`_timeout`), which
    the default group's collectives keep."""
    timeout = strategy._timeout
    strategy._timeout = max(timeout, join_timeout or timeout)
    try:
        strategy._setup_distributed()
    finally:
        strategy._timeout = timeout
    set_group_timeout(None, timeout)


def process_group_backend(strategy: ParallelStrategy) -> str:
    """The backend the strategy's process group uses (its `process_group_backend`, else the device's default)."""
    from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device

    return getattr(strategy, "_process_group_backend", None) or _get_default_process_group_backend_for_device(
        strategy.root_device
    )


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """torch's fake process group as the default group, for `rank` of `world_size`: collectives return at once and
    move nothing, so one process can build any rank's mesh and shard a meta model as that rank would (torch's test
    utility `torch.testing._internal.distributed.fake_pg`, which registers the "fake" backend)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def set_group_timeout(group: Any, timeout: timedelta) -> None:
    """Make collectives on `group` (None: the default group) fail after `timeout` (torch's `_set_pg_timeout`)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def process_group_named(name: str) -> Any:
    """The process group a functional collective names by its `group_name` (torch's `_resolve_process_group`)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def set_device_mesh(strategy: ParallelStrategy, mesh: DeviceMesh) -> None:
    """Give the strategy and its LightningModule their mesh (`strategy.device_mesh`, `self.device_mesh`), which
    Lightning's ModelParallelStrategy keeps in `_device_mesh` on both."""
    strategy._device_mesh = mesh
    strategy.lightning_module._device_mesh = mesh


def saves_distributed_checkpoint(strategy: ParallelStrategy) -> bool:
    """The `save_distributed_checkpoint` a ModelParallelStrategy was built with."""
    return strategy._save_distributed_checkpoint


def run_as_forward(module: Module, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call `module.<method>(*args, **kwargs)` through `module(...)`, so that its forward hooks run around it (what
    Lightning's `_ForwardRedirection` does for its DDP and FSDP1 wrappers).

    Inside, calling the module itself (`self(x)` in a training_step) runs its `forward` alone, not its hooks again:
    FSDP2's, nested, would leave the root's parameter group idle at the inner call's end, so that the outer call's
    end frees the root's gathered parameters and backward gathers them a second time. nn.Module's call runs
    `_compiled_call_impl` instead of its hooks when one is set (what `Module.compile()` sets).
    """
    step = getattr(module, method)
    own_forward = vars(module).get("forward")  # an instance's own forward, else the class's

    def restore_forward() -> None:
        if own_forward is not None:
            module.forward = own_forward
        else:
            vars(module).pop("forward", None)

    def forward(*inner_args: Any, **inner_kwargs: Any) -> Any:
        restore_forward()
        compiled = module._compiled_call_impl
        module._compiled_call_impl = module.forward
        try:
            return step(*inner_args, **inner_kwargs)
        finally:
            module._compiled_call_impl = compiled

    module.forward = forward
    try:
        return module(*args, **kwargs)
    finally:
        restore_forward()  # also when a hook failed before the forward ran


def skip_loop_backward(trainer: L.Trainer) -> None:
    """Tell the fit loop not to run zero_grad and backward itself (the switch Lightning's StochasticWeightAveraging
    uses): a pipeline schedule's step runs both."""
    trainer.fit_loop._skip_backward = True


def should_accumulate(trainer: L.Trainer) -> bool:
    """Whether the current micro-batch is not the last of an optimizer step (the fit loop's own test)."""
    return trainer.fit_loop._should_accumulate()


def logging_a_step(trainer: L.Trainer) -> bool:
    """Whether the fit loop is in a training batch's end hooks (`on_train_batch_end`, where ModelCheckpoint saves),
    whose metrics it hands to the loggers only after all of them have run."""
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return trainer.training and progress.processed > progress.completed


def throughputs(monitor: Callback) -> dict[Any, Any]:
    """The `Throughput` meters Lightning's ThroughputMonitor keeps per stage, to replace with other kinds."""
    return monitor._throughputs


def note_sigterm(trainer: L.Trainer) -> None:
    """Raise the flag Lightning's training loop broadcasts from rank 0 every step and turns into a
    `SIGTERMException` on every rank, without running Lightning's own handler (see `PreemptionCheckpoint`)."""
    trainer._signal_connector.received_sigterm = True


def skip_sigterm_broadcast(trainer: L.Trainer) -> None:
    """Stop the training loop's blocking broadcast of rank 0's SIGTERM flag before every step: `PreemptionCheckpoint`
    already raises the flag on every rank at the same step, which the loop then turns into `SIGTERMException` at
    the end of that step as before."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


def last_checkpoints(callback: Any, trainer: L.Trainer) -> set[str]:
    """The `last*.ckpt` entries of a ModelCheckpoint's directory: what `ckpt_path="last"` resumes from (Lightning's
    `ModelCheckpoint._find_last_checkpoints`)."""
    return callback._find_last_checkpoints(trainer)


def last_step_saved(callback: Any) -> int:
    """The global step of a ModelCheckpoint's newest save this run (0 before any)."""
    return callback._last_global_step_saved


def parser_keys(parser: Any, subcommand: str | None) -> list[str]:
    """The option keys LightningCLI's (jsonargparse's) parser knows for `subcommand` (or its own without one), from
    argparse's `_actions` and jsonargparse's `_subcommands_action`."""
    subcommands = getattr(parser, "_subcommands_action", None)
    chosen = subcommands.choices.get(subcommand) if subcommands is not None and subcommand else None
    target = chosen or parser
    return [action.dest for action in target._actions if action.dest and not action.dest.startswith("_")]


# -- torch -------------------------------------------------------------------------------------------------------
def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """One mesh axis named `name` spanning every axis of `mesh` (a sub-mesh of the root). torch 2.13:
    `DeviceMesh._flatten`, the only way to get one group spanning several mesh axes."""
    return mesh._flatten(name)


def mesh_with_flattened(root: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The sub-mesh of `root` over `names`, some of them axes `flatten_mesh` made (HSDP over (replicate, fsdp x ep)).
    torch 2.13 slices those from the root mesh and warns that it will stop: there is no other way to get a 2-D mesh
    whose second axis is a flattened one. The warning is silenced here only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
        return root[names]


def flattened_meshes(root: DeviceMesh) -> dict[str, DeviceMesh]:
    """The meshes `flatten_mesh` made from `root`, by name (torch keeps them on the root mesh)."""
    return root._flatten_mapping


def composable_checkpoint(module: Module) -> None:
    """Recompute `module`'s activations in backward, keeping its parameter names (torch's composable
    `checkpoint`, which the public `torch.utils.checkpoint` has no module form of)."""
    from torch.distributed._composable import checkpoint

    checkpoint(module)


def checkpointed_submodules(module: Module) -> list[Module]:
    """The modules under `module` (itself included) that `composable_checkpoint` made recompute their activations."""
    from torch.distributed._composable.contract import _get_registry

    return [m for m in module.modules() if "checkpoint" in (_get_registry(m) or {})]


def recomputing(module: Module) -> bool:
    """Whether a checkpointed `module`'s forward now running is backward's recomputation (torch's composable
    checkpoint turns its own hooks off for it)."""
    from torch.distributed._composable import checkpoint

    return not checkpoint.state(module).enable_hook


def saved_tensors_hooks_in_force() -> tuple[Any, Any] | None:
    """The (pack, unpack) pair autograd calls now, the innermost `saved_tensors_hooks`; None when there are none."""
    import torch

    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def grouped_mm(x: Any, weight: Any, offsets: Any) -> Any:
    """`x` (rows grouped by expert, group `g` ending at row `offsets[g]`) times `weight[g]` (E, in, out) per group.
    torch 2.13: `torch._grouped_mm` (no public name yet; CUDA and CPU kernels, differentiable)."""
    import torch

    return torch._grouped_mm(x, weight, offs=offsets)


def grouped_mm_runs(x: Any, weight: Any) -> bool:
    """Whether `grouped_mm` takes these operands: the kernel wants fp32/bf16 rows 16-byte aligned, plain tensors."""
    import torch

    if not hasattr(torch, "_grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16) or x.dtype != weight.dtype:
        return False
    per_16_bytes = 16 // x.element_size()
    return all(size % per_16_bytes == 0 for size in weight.shape[1:]) and type(weight) is type(x)


def registered_parameters(module: Module) -> dict[str, Any]:
    """`module`'s own parameters by name, as the dict it looks them up in: a tensor put there is what the module's
    forward sees under that name, without registration (FSDP2 swaps gathered parameters in the same way). torch:
    `nn.Module._parameters`."""
    return module._parameters


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (as when activation checkpointing recomputes a forward).
    torch 2.13: `torch._C._current_graph_task_id()`, -1 outside a backward."""
    import torch

    return torch._C._current_graph_task_id() != -1


def all_to_all_autograd(tensor: Any, output_sizes: list[int], input_sizes: list[int], group: Any) -> Any:
    """Rows of `tensor` exchanged within `group` (`input_sizes` rows to each rank, `output_sizes` from each), with a
    backward that sends the gradients back. torch 2.13: `_functional_collectives.all_to_all_single_autograd` (the
    public `torch.distributed.nn.functional.all_to_all_single` is deprecated in its favour)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(tensor, output_sizes, input_sizes, group))


def settle_async_collectives(tree: Any) -> Any:
    """`tree` with every `AsyncCollectiveTensor` (what a tensor-parallel style's `to_local()` returns while its
    collective may still run) replaced by a plain copy of its value that autograd links to it.

    A compiled region takes plain tensors: handed an AsyncCollectiveTensor (e.g. the embedding's output, under tensor
    parallelism) as an input, torch 2.13's AOTAutograd routes the input's gradient past the wrapper's backward into
    the DTensor redistribution before it, which then fails on a plain tensor or, under FSDP, yields wrong gradients.
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.utils._pytree import tree_map_only

    return tree_map_only(AsyncCollectiveTensor, lambda tensor: tensor.clone(), tree)


def saved_tensors_hooks_active() -> bool:
    """Whether a `torch.autograd.graph.saved_tensors_hooks` context is active (the innermost one's hooks exist)."""
    import torch

    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


def keep_profiler_ranges() -> Any:
    """A context in which torch.compile traces `record_function` ranges into its graph (an optimizer's
    "Optimizer.step#AdamW.step"), where by default it drops them with a warning."""
    import torch._dynamo

    return torch._dynamo.config.patch(capture_profiler_record_function=True)


def keep_scheduler_mark(new: Any, old: Any) -> None:
    """Give the function replacing an optimizer's `step` the mark an LR scheduler left on the old one, if any (the
    scheduler warns at its first step when the mark is gone, and wraps a step without it)."""
    if hasattr(old, "_wrapped_by_lr_sched"):
        new._wrapped_by_lr_sched = True


def dispatch_mode_class() -> type:
    """torch's `TorchDispatchMode`: sees every aten op, the c10d collectives included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def storage_key(tensor: Tensor) -> tuple[int, int]:
    """The identity and size of the storage `tensor` (or a DTensor's local shard) lives in. Identity, not address:
    every meta tensor sits at address 0."""
    from torch.distributed.tensor import DTensor

    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    storage = local.untyped_storage()
    return storage._cdata, storage.nbytes()


def view_base(tensor: Tensor) -> Tensor:
    """The tensor `tensor` is a view of, or itself."""
    return tensor._base if tensor._base is not None else tensor


def apply_to_tensors(module: Module, fn: Any) -> None:
    """Replace every parameter and buffer `t` of `module` by `fn(t)` in place, keeping Parameter objects
    (`nn.Module._apply`, which `to()` and `to_empty()` are made of; those apply to every tensor alike)."""
    module._apply(fn)


def flash_attention_on_cpu(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None) -> Tensor:
    """The output of the fused (flash) SDPA kernel for CPU, whatever the device of q, k, v (meta included)."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)[0]


def local_box(tensor: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """This rank's part of `tensor` and where it starts in the whole: a DTensor's local shard and its global
    offsets (DTensor's DCP protocol, `__create_chunk_list__`, which also places FSDP-over-TP strided shards), or a
    plain tensor whole at offset 0."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor, (0,) * tensor.ndim
    (chunk,) = tensor.__create_chunk_list__()
    return tensor.to_local(), tuple(chunk.offsets)


def dcp_metadata_global(module: str, name: str) -> Any | None:
    """The object a DCP `.metadata` pickle may name as `module.name`, or None for anything else.

    DCP pickles its `Metadata` dataclass tree: the classes of `torch.distributed.checkpoint.metadata` (its
    `_MEM_FORMAT_ENCODING` enum among them), the file reader's `_StorageInfo` (where each item's bytes lie), tensor
    sizes (`torch.Size`), dtypes (`torch.float32`: a torch attribute), layouts (rebuilt by `torch.serialization.
    _get_layout` from their name; it returns layouts only) and the checkpoint's path (`pathlib`). Nothing here runs
    code chosen by the file: constructing these with any arguments stores them.
    """
    import pathlib

    import torch
    import torch.distributed.checkpoint.metadata as dcp_metadata
    from torch.distributed.checkpoint import filesystem

    if module == dcp_metadata.__name__:
        found = getattr(dcp_metadata, name, None)
        return found if isinstance(found, type) and found.__module__ == module else None
    if module == "torch":
        found = getattr(torch, name, None)
        plain = isinstance(found, (torch.dtype, torch.layout, torch.memory_format))
        return found if plain or found is torch.Size else None
    exact = {
        (filesystem.__name__, "_StorageInfo"): filesystem._StorageInfo,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        **{("pathlib", path.__name__): path for path in (pathlib.PosixPath, pathlib.WindowsPath)},
        **{("pathlib", path.__name__): path for path in (pathlib.PurePosixPath, pathlib.PureWindowsPath)},
    }
    return exact.get((module, name))


# -- transformers ------------------------------------------------------------------------------------------------
def hf_tp_plan(model: Module) -> dict[str, str]:
    """A Hugging Face model's whole tensor-parallel plan (module glob -> HF style name), its own entries (e.g.
    `lm_head`) and its base model's, prefixed, as `PreTrainedModel.post_init` gathers them into `_tp_plan`."""
    return dict(model._tp_plan or {})


def hf_pp_plan(model: Module) -> dict[str, Any]:
    """A Hugging Face causal LM's pipeline pieces in order (module name -> (input names, output names)): its base
    model's `config.base_model_pp_plan`, prefixed, then its own (`_pp_plan`, the head)."""
    base = model.base_model_prefix
    pieces = {f"{base}.{name}": io for name, io in (model.config.base_model_pp_plan or {}).items()}
    return {**pieces, **(type(model)._pp_plan or {})}


def hf_ep_plan(model: Module) -> dict[str, str]:
    """A Hugging Face model's expert-parallel plan (module glob -> HF style name): its base model's
    `config.base_model_ep_plan`, prefixed with the base model's name (as `hf_tp_plan`'s entries are)."""
    base = model.base_model_prefix
    return {
        f"{base}.{name}": style for name, style in (getattr(model.config, "base_model_ep_plan", None) or {}).items()
    }


def hf_conversions(model: Module) -> list[Any]:
    """How a transformers model's tensors are saved when they differ from how it holds them (fused experts saved one
    expert at a time, legacy names): `WeightRenaming`/`WeightConverter` objects, as `from_pretrained` applies them.
    transformers 5.x: `conversion_mapping.get_model_conversion_mapping` (not exported at the top level; PEFT uses
    it)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return list(get_model_conversion_mapping(model))


def hf_supports_sdpa(config: Any) -> bool:
    """Whether the causal-LM class transformers builds for `config` runs torch's scaled_dot_product_attention (its
    `_supports_sdpa`; Gemma 2's does not, for its attention softcapping). Unknown to the causal-LM mapping: True."""
    import transformers

    try:
        family = transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return True
    return bool(family._supports_sdpa)


def hf_initialize(model: Module) -> None:
    """Run a Hugging Face model's own weight initialisation (`_init_weights` on every module) again, on tensors
    that already exist. transformers marks modules and tensors it initialised with `_is_hf_initialized` and skips
    them afterwards; the marks are cleared first."""
    for obj in (*model.modules(), *model.parameters(), *model.buffers()):
        if getattr(obj, "_is_hf_initialized", False):
            obj._is_hf_initialized = False
    model.initialize_weights()


# -- noise -------------------------------------------------------------------------------------------------------
class _WithoutTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


class _Without(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(str(record.msg) % record.args if record.args else str(record.msg))


def quiet_known_noise() -> None:
    """Silence, precisely, what is printed on every run that is neither about the user's code nor actionable:
    Lightning's own use of a torch API that torch 2.13 deprecated and its advertisements for cloud services; and,
    where torchao is installed (transformers imports it with every model), its optional CUDA kernels built for
    another Python failing to load (NF4 needs none of them) and torch telling torchao's developers that registering
    its Enums is deprecated. Every other warning, torch's, torchao's and Lightning's included, still shows."""
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", module=r"lightning\.pytorch\.utilities"
    )
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_WithoutTips())
    logging.getLogger("torchao").addFilter(_Without(r"^Failed to load .*/torchao/_C[^/]*\.so: "))
    logging.getLogger("torch.utils._pytree").addFilter(
        _Without(r"is an Enum subclass and is now natively supported by torch\.compile")
    )


@contextlib.contextmanager
def lightning_quiet_about_precision() -> Iterator[None]:
    """Within: no "Using bfloat16 Automatic Mixed Precision (AMP)" from a Trainer built to read the run's layout
    (`parallelkit check`), which trains nothing."""
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    quiet = _Without(r"^Using (16bit|bfloat16) Automatic Mixed Precision")
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def quiet_root_view_warning(root: Module) -> None:
    """FSDP2 warns when a sharded module returns a view: an in-place op on it would drop the module's pre-backward
    hook, which gathers the module's parameters again for backward. Silenced, for this root class only, where that
    hook has nothing to do: parallelkit runs every step as the root's forward (`ParallelkitStrategy._in_root_forward`),
    so a model calling `self(x)` in its step calls the root a second time, and the output of that inner call
    (logits: a view when tensor parallelism hands back its local shard) carries a hook that the step's own output
    carries too; a pipeline stage's root keeps its parameters gathered until its backward (`reshard_after_forward`
    "never", its default). The same warning about any other module still shows."""
    warnings.filterwarnings(
        "ignore",
        message=rf"FSDP2-wrapped module \({re.escape(type(root).__name__)}\) returned a view tensor",
        module=r"torch\.distributed\.fsdp",
    )


def model_class_name(model: Module) -> str:
    """The model's own class name (fully_shard swaps in a generated `FSDP<Name>` subclass)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__
