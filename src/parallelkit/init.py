"""Meta-device initialisation: build a model without its memory, shard it, then give each rank only its shards.

A model larger than one process's memory cannot be built whole and then sharded. With `meta_init=True` a
parallelkit strategy builds the model's parameters on the meta device (shapes, no storage), applies its plan
(tensor parallel, pipeline split, FSDP) to the empty model, and only then allocates each rank's shards and
initialises them.

Initialisation stays layout-independent, and equals the eager build's from the same seed: every module's
`reset_parameters()` and then the model's `init_weights()` are replayed in module order, as an eager build calls
them, and each random initialiser that meets a sharded parameter draws the *whole* parameter in CPU memory from
torch's global generator (so the generator advances exactly as in the eager build), keeps this rank's shard and
frees the rest. One parameter is whole at a time, never the model. Parameters of pipeline layers a rank does not
hold are drawn and discarded for the same reason.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager
from types import MethodType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from parallelkit.compat import apply_to_tensors, model_class_name
from parallelkit.errors import ConfigError

RANDOM_METHODS = frozenset(
    {"normal_", "uniform_", "bernoulli_", "exponential_", "cauchy_", "log_normal_", "geometric_", "random_"}
)
"""In-place tensor methods that draw from a generator: applied to a shard, they must draw the whole tensor."""


CONSTRUCTED_UP_TO = 4096
"""`meta_parameters(constructed=...)` keeps the values of parameters up to this many elements."""


@contextmanager
def meta_parameters(
    constructed: dict[tuple[nn.Module, str], torch.Tensor] | None = None,
) -> Generator[None, None, None]:
    """Inside, every parameter a module registers moves to the meta device; buffers and other tensors stay real.

    Unlike `torch.device("meta")`, buffers computed in `__init__` (rotary tables, masks) and torchmetrics states,
    which `to_empty()` cannot restore, keep their values. A parameter's eager tensor is allocated but rarely
    written before it moves (modules initialise after registering), so it costs no memory. Some modules do set a
    small parameter's value in their constructor (a learnable activation's scalars): `constructed`, when given,
    receives `{(module, name): value}` for every parameter of up to `CONSTRUCTED_UP_TO` elements, for an
    initialisation that leaves such parameters alone.
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            if constructed is not None and param.numel() <= CONSTRUCTED_UP_TO:
                constructed[(module, name)] = param.detach().clone()
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def building_on_meta() -> bool:
    """True inside `meta_parameters()` or a `torch.device("meta")` context: a model built now gets no storage, and
    is materialised later (by a strategy with `meta_init`, or never: the planner only counts it)."""
    return nn.Module.register_parameter is not _REGISTER_PARAMETER or torch.get_default_device().type == "meta"


_REGISTER_PARAMETER = nn.Module.register_parameter


def has_meta_tensors(module: nn.Module, recurse: bool = True) -> bool:
    return any(t.is_meta for t in (*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)))


def materialize(model: nn.Module, device: torch.device, modules: Mapping[str, nn.Module]) -> None:
    """Allocate `model`'s meta parameters and buffers on `device` (this rank's shards of sharded ones) and
    initialise them as an eager build of the model would have from the generator's current state.

    `modules`: the model's modules by name as built, before a pipeline split dropped the layers other ranks hold.
    Their initialisers are replayed too (drawing what an eager build draws), so a stage's weights do not depend
    on which stages came before it.
    """
    _check_initialisable(model, modules)
    tied = tied_parameters(model)
    apply_to_tensors(model, lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    retie(model, tied)  # a meta parameter is replaced by a new one per module that holds it
    # A model whose init_weights() reads every parameter from a checkpoint needs no random draws to match.
    replay = not getattr(model, "loads_every_parameter", False)
    with _restored(model, modules), torch.no_grad(), _WholeTensorInit():
        for module in modules.values() if replay else ():
            if _holds_tensors(module) and callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
        if callable(getattr(model, "init_weights", None)):
            model.init_weights()


def tied_parameters(model: nn.Module) -> list[list[str]]:
    """Names under which one parameter is registered more than once (tied weights), each group in module order."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def retie(model: nn.Module, tied: list[list[str]]) -> None:
    """Register each group's first parameter under the group's other names again (`tied_parameters` groups)."""
    for first, *others in tied:
        shared = model.get_parameter(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner) if owner else model
            if getattr(module, leaf) is not shared:
                module.register_parameter(leaf, shared)


def _holds_tensors(module: nn.Module) -> bool:
    return any(True for _ in (*module.parameters(recurse=False), *module.buffers(recurse=False)))


def _check_initialisable(model: nn.Module, modules: Mapping[str, nn.Module]) -> None:
    if callable(getattr(model, "init_weights", None)):
        return
    blind = sorted(
        {
            f"{name} ({type(module).__name__})"
            for name, module in modules.items()
            if has_meta_tensors(module, recurse=False) and not callable(getattr(module, "reset_parameters", None))
        }
    )
    if blind:
        raise ConfigError(
            f"meta_init=True builds {model_class_name(model)} on the meta device, but {', '.join(blind[:5])} hold "
            "parameters or buffers and have no reset_parameters(), and the model has no init_weights() to "
            "initialise them after sharding: their weights would be uninitialised memory. Define one of those "
            "methods (README: the model contract), or set meta_init=False."
        )


@contextmanager
def _restored(model: nn.Module, modules: Mapping[str, nn.Module]) -> Generator[None, None, None]:
    """Put layers a pipeline split dropped back under their names while the model's `init_weights()` runs."""
    emptied = []
    for name, module in modules.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        if leaf and getattr(parent, leaf, module) is None:  # a slot the split emptied
            parent.register_module(leaf, module)
            emptied.append((parent, leaf))
    try:
        yield
    finally:
        for parent, leaf in emptied:
            parent.register_module(leaf, None)


class _WholeTensorInit(TorchFunctionMode):
    """Random initialisers on a sharded, non-CPU or not-held tensor draw the whole tensor on the CPU first."""

    def __torch_function__(self, func: Callable, types: Iterable[type], args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        initialiser = name in RANDOM_METHODS or getattr(func, "__module__", None) == "torch.nn.init"
        target = kwargs.get("tensor", args[0] if args else None)
        if name == "copy_" and _whole_source(target, args):
            with torch.no_grad():
                return set_whole(target, args[1])
        if not initialiser or not isinstance(target, torch.Tensor) or not _drawn_whole(target):
            return func(*args, **kwargs)
        whole = torch.empty(target.shape, dtype=target.dtype)
        with torch.no_grad():  # an initialiser writes parameters as torch.nn.init does: outside autograd
            if "tensor" in kwargs:
                func(*args, **{**kwargs, "tensor": whole})
            else:
                func(whole, *args[1:], **kwargs)
            return set_whole(target, whole)


REDRAWING_HOOKS = ("on_fit_start", "on_train_start")
"""LightningModule hooks in which models draw their weights again once they are split (Lightning's
tensor-parallel example calls its `init_weights()` in `on_train_start`)."""


def draw_whole_in_hooks(module: nn.Module) -> None:
    """Make random initialisers in `module`'s `REDRAWING_HOOKS` draw each split tensor whole from the generator and
    keep this rank's part, as `materialize` does: the weights then equal one process's. (On the CPU, torch draws a
    DTensor's shard from each rank's own generator: every shard would hold the same values.)"""
    for hook in REDRAWING_HOOKS:
        if hook in vars(module):  # already wrapped (a second fit with the same module)
            continue
        setattr(module, hook, MethodType(_drawing_whole(hook), module))


def _drawing_whole(hook: str) -> Callable[..., Any]:
    def run(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with _WholeTensorInit():
            return getattr(type(self), hook)(self, *args, **kwargs)

    return run


def _drawn_whole(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor) or tensor.device.type != "cpu"


def _whole_source(target: Any, args: tuple) -> bool:
    """`sharded.copy_(whole)`: a full-size plain tensor copied into a sharded parameter keeps this rank's part."""
    from torch.distributed.tensor import DTensor

    source = args[1] if len(args) > 1 else None
    return (
        isinstance(target, DTensor)
        and isinstance(source, torch.Tensor)
        and not isinstance(source, DTensor)
        and source.shape == target.shape
    )


def set_whole(target: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """Write this rank's part of `whole` (a plain tensor of `target`'s global shape) into `target`."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if target.is_meta:
        return target  # a layer another pipeline rank holds: drawn only to keep the generator in step
    if isinstance(target, DTensor):
        # src_data_rank=None: no communication; every rank cuts its own part out of its own copy.
        shard = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(whole)
    return target
