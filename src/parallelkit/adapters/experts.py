"""LoRA on a mixture of experts' experts: one low-rank pair per expert on an experts module's stacked parameters.

`lora.targets` naming an experts parameter (`mlp.experts.gate_up_proj`, PEFT's `target_parameters` spelling) gives
its module, for that parameter `W` [E, out, in], the parameters `<name>_lora_A` [E, rank, in] and `<name>_lora_B`
[E, out, rank] (`adapt_experts`), and its forward computes with `W[e] + alpha / rank * B[e] @ A[e]` for each expert
(`adapted_weights`): PEFT's math for a 3-D parameter, so adapters move between the two (`peft_names`). Their leading
dimension is the experts', so what the strategies do to experts they do to their adapters: expert parallelism gives
each rank its experts' adapters, FSDP shards them as the experts, a pipeline stage holds its layers'. The base stays
frozen; only the adapters have gradients and optimizer state. QLoRA (`quantize_base: nf4`) stores the adapted
experts parameters in NF4, expert by expert (`parallelkit.adapters.nf4.pack_experts`: `<name>_nf4`, uint8 rows that
expert parallelism and FSDP divide as they divide the experts), dequantized a layer at a time in its forward.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from parallelkit.adapters.nf4 import EXPERTS_SUFFIX, pack_experts, unpack_experts
from parallelkit.compat import local_box, registered_parameters, saved_tensors_hooks_in_force, storage_key
from parallelkit.contract import EXPERT_WEIGHTS_HOOK, matches_suffix
from parallelkit.errors import ConfigError
from parallelkit.init import set_whole

SUFFIXES = ("_lora_A", "_lora_B")
"""What an experts parameter's adapters are named after it: `gate_up_proj_lora_A`, `gate_up_proj_lora_B`."""

DENSE_ADAPTERS = ("lora_A", "lora_B")
"""A linear layer's adapters (`parallelkit.adapters.lora.LoRALinear`), named alone."""


class ExpertAdapter:
    """Adapters on one stacked experts parameter `W` [E, out, in] (`gate_up_proj`, `down_proj`): per expert e, the
    module's parameters `<name>_lora_A[e]` (rank x in) and `<name>_lora_B[e]` (out x rank), and
    `W[e] + scaling * B[e] @ A[e]` is what the experts' own code computes with (`adapted_weights`), as PEFT's
    `target_parameters` adapters do. Their leading dimension is the experts', so expert parallelism divides them with
    their experts, and FSDP shards them as it shards the experts."""

    def __init__(self, name: str, rank: int, scaling: float, seed: int, quantize: str | None = None) -> None:
        self.name, self.rank, self.scaling, self.seed, self.quantize = name, rank, scaling, seed, quantize
        self.stored: tuple[tuple[int, int], torch.dtype] | None = None  # once in NF4: an expert's shape, W's dtype

    @property
    def names(self) -> tuple[str, str]:
        return f"{self.name}_lora_A", f"{self.name}_lora_B"

    @torch.no_grad()
    def reset(self, module: nn.Module) -> None:
        """A Kaiming-uniform on each expert's in features (PEFT's, drawn from a generator seeded by the run's seed and
        the parameter's name), B zero."""
        a, b = (getattr(module, name) for name in self.names)
        generator = torch.Generator().manual_seed(self.seed)
        bound = 1 / math.sqrt(a.shape[-1])
        values = torch.empty(a.shape, dtype=a.dtype).uniform_(-bound, bound, generator=generator)
        set_whole(a, values.to(a.device))
        set_whole(b, torch.zeros(b.shape, dtype=b.dtype, device=b.device))


def adapt_experts(
    module: nn.Module, names: list[str], rank: int, scaling: float, seeds: list[int], quantize: str | None = None
) -> None:
    """Give the experts module `module` adapters of `rank` on its stacked parameters `names` (`ExpertAdapter`; their
    base to be stored as `quantize` says, `quantize_experts`), and run its forward with the adapted weights; expert
    parallelism, which replaces that forward, enters them itself (`parallelkit.contract.EXPERT_WEIGHTS_HOOK`)."""
    adapters = getattr(module, "expert_adapters", None)
    if adapters is None:
        adapters = module.expert_adapters = {}
        forward = type(module).forward

        def adapted_forward(*args: Any, **kwargs: Any) -> Any:
            with adapted_weights(module):
                return forward(module, *args, **kwargs)

        module.forward = adapted_forward
        setattr(module, EXPERT_WEIGHTS_HOOK, partial(adapted_weights, module))
    for name, seed in zip(names, seeds):
        weight = getattr(module, name)
        experts, out_features, in_features = weight.shape
        adapter = adapters[name] = ExpertAdapter(name, rank, scaling, seed, quantize)
        shapes = ((experts, rank, in_features), (experts, out_features, rank))
        for param_name, shape in zip(adapter.names, shapes):
            param = torch.empty(shape, device=weight.device, dtype=weight.dtype)
            module.register_parameter(param_name, nn.Parameter(param))
        if not weight.is_meta:
            adapter.reset(module)


@contextmanager
def adapted_weights(module: nn.Module) -> Iterator[None]:
    """While it lasts, the experts module's adapted parameters are `W + scaling * B @ A`, expert by expert (one
    `baddbmm`, in W's dtype, as PEFT folds them), where its forward reads them; whatever they are then (FSDP's
    gathered parameters, expert parallelism's local ones). A W stored in NF4 is dequantized here, in the adapters'
    dtype (the compute dtype under FSDP's mixed precision)."""
    adapters = getattr(module, "expert_adapters", None)
    if not adapters:
        yield
        return
    registered = registered_parameters(module)
    saved = {name: registered.get(name) for name in adapters}
    remade = []
    for name, adapter in adapters.items():
        a, b = (registered[n] for n in adapter.names)
        stored = registered.get(name + EXPERTS_SUFFIX)
        make = partial(_adapted, adapter, saved[name] if stored is None else stored, a, b)
        registered[name] = make()
        remade.append(_Remade(registered[name], make))
    try:
        with _made_again_in_backward(remade):
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                del registered[name]
            else:
                registered[name] = value


def _adapted(adapter: ExpertAdapter, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`base + scaling * B @ A` per expert; `base` the stored NF4 rows when the adapter's base is stored so."""
    if adapter.stored is not None:
        shape, dtype = adapter.stored
        base = unpack_experts(base, shape, dtype).to(a.dtype)
    return torch.baddbmm(base, b.to(base.dtype), a.to(base.dtype), alpha=adapter.scaling)


class _Remade:
    """A layer's adapted weights: what autograd saves of them (views the experts' code hands its matmuls) is made
    again in backward from the base and the adapters, once for all of them, and dropped once the last is used."""

    def __init__(self, tensor: torch.Tensor, make: Any) -> None:
        self.storage, self.make = storage_key(tensor), make  # identity, not address (meta tensors share 0)
        self.value: torch.Tensor | None = None
        self.pending = 0

    def holds(self, tensor: torch.Tensor) -> bool:
        return storage_key(tensor) == self.storage

    def take(self, size: torch.Size, stride: tuple[int, ...], offset: int) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad():
                self.value = self.make()
        view = self.value.as_strided(size, stride, offset)
        self.pending -= 1
        if self.pending <= 0:
            self.value = None
        return view


@contextmanager
def _made_again_in_backward(remade: list[_Remade]) -> Iterator[None]:
    """While it lasts, a tensor autograd saves that is a view of one of `remade`'s adapted weights is kept as the
    recipe to make it again (`_Remade`), not as the full-precision weight: a layer's adapted (for QLoRA, dequantized)
    experts live during its forward and again during its backward, not from one to the other. Other tensors go to
    the saved-tensor hooks in force outside (activation checkpointing's, a memory monitor's), or are kept."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        yield
        return
    outer = saved_tensors_hooks_in_force()
    outer_pack, outer_unpack = outer if outer is not None else (lambda t: t, lambda t: t)

    def pack(tensor: torch.Tensor) -> Any:
        owner = next((each for each in remade if each.holds(tensor)), None)
        if owner is None:
            return ("kept", outer_pack(tensor))
        owner.pending += 1
        return ("remade", owner, tensor.size(), tensor.stride(), tensor.storage_offset())

    def unpack(packed: Any) -> torch.Tensor:
        if packed[0] == "kept":
            return outer_unpack(packed[1])
        return packed[1].take(*packed[2:])

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def quantize_experts(
    module: nn.Module,
    read: Callable[[str, slice], torch.Tensor | None] | None,
    device: torch.device | None,
    prefix: str,
) -> list[str]:
    """Store each adapted parameter of the experts module `module` whose adapter asks for NF4 as `<name>_nf4`
    (`pack_experts`: this rank's experts, quantized one by one), once: values it holds as they are, a meta one's
    from `read(f"{prefix}{name}", rows)` (its experts' rows of the pretrained weight), left as it is when `read` has
    none. Expert parallelism's DTensor (Shard(0)) stays one, of the stored rows. Returns the names quantized now."""
    from torch.distributed.tensor import DTensor

    registered, done = registered_parameters(module), []
    for name, adapter in getattr(module, "expert_adapters", {}).items():
        if adapter.quantize != "nf4" or adapter.stored is not None:
            continue
        weight = registered[name]
        local, offsets = local_box(weight)
        if weight.is_meta:
            rows = slice(offsets[0], offsets[0] + local.shape[0])
            values = read(f"{prefix}{name}", rows) if read is not None else None
            if values is None:
                continue
        else:
            values = local.detach()
        stored = pack_experts(values.to(device or values.device, weight.dtype), f"{prefix}{name}")
        if isinstance(weight, DTensor):
            whole = (weight.shape[0], stored.shape[1])
            stored = DTensor.from_local(
                stored, weight.device_mesh, weight.placements, shape=whole, stride=(whole[1], 1)
            )
        del registered[name]
        module.register_parameter(name + EXPERTS_SUFFIX, nn.Parameter(stored, requires_grad=False))
        adapter.stored = (tuple(weight.shape[1:]), weight.dtype)
        done.append(f"{prefix}{name}")
    return done


def unquantized_experts(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The experts parameters of `model` waiting to be stored in NF4 (by name), as they are now."""
    return [
        (f"{owner}.{name}" if owner else name, getattr(module, name))
        for owner, module in model.named_modules()
        for name, adapter in getattr(module, "expert_adapters", {}).items()
        if adapter.quantize == "nf4" and adapter.stored is None
    ]


def expert_parameters(model: nn.Module) -> list[str]:
    """The stacked experts parameters of `model` by name: 3-D parameters, one slice per expert, of a module that
    counts its experts (`num_experts`), e.g. transformers' `mlp.experts.gate_up_proj`."""
    return [
        f"{owner}.{name}" if owner else name
        for owner, module in model.named_modules()
        for name, param in module.named_parameters(recurse=False)
        if param.dim() == 3 and getattr(module, "num_experts", None) == param.shape[0] and not name.endswith(SUFFIXES)
    ]


def adapted_weight(adapter: str) -> str:
    """The weight an adapter's parameter adapts: `...q_proj.lora_A` -> `...q_proj.weight`,
    `...experts.gate_up_proj_lora_B` -> `...experts.gate_up_proj`."""
    owner, _, stem = adapter.rpartition(".")
    if stem in DENSE_ADAPTERS:
        return f"{owner}.weight"
    return f"{owner}.{stem.rsplit('_lora_', 1)[0]}"


def adapter_keys(weight: str) -> tuple[str, str]:
    """The (A, B) parameters adapting `weight` (`adapted_weight`'s inverse)."""
    if weight.endswith(".weight"):
        module = weight.removesuffix(".weight")
        return f"{module}.lora_A", f"{module}.lora_B"
    return f"{weight}_lora_A", f"{weight}_lora_B"


def expert_targets(targets: list[str] | str, names: list[str]) -> dict[str, list[str]]:
    """The experts parameters among `names` (adapter names, `...experts.gate_up_proj_lora_A`) by experts module, each
    module's in the order of the first `targets` entry naming them: the order PEFT nests its parameter wrappers in."""
    found: dict[str, set[str]] = {}
    for name in names:
        stem = name.rpartition(".")[2]
        if "." in name and stem.endswith(SUFFIXES):
            owner = name.rpartition(".")[0]
            found.setdefault(owner, set()).add(stem.rsplit("_lora_", 1)[0])
    patterns = [targets] if isinstance(targets, str) else list(targets)

    def order(owner: str, attr: str) -> int:
        return next((i for i, p in enumerate(patterns) if matches_suffix(p, f"{owner}.{attr}")), len(patterns))

    return {owner: sorted(attrs, key=lambda attr: (order(owner, attr), attr)) for owner, attrs in found.items()}


def peft_key(name: str, nesting: dict[str, list[str]]) -> str:
    """PEFT's name of the adapter `name` (parallelkit's), without PEFT's `base_model.model.` prefix and adapter name:
    `<module>.lora_A.weight` for a linear layer's; for an experts parameter's, on the parameter's wrapper:
    `<experts>.lora_A.weight` for the last targeted parameter of the module (`nesting`: `expert_targets`) and one
    more `base_layer.` for each before it."""
    owner, _, stem = name.rpartition(".")
    if stem in DENSE_ADAPTERS:
        return f"{name}.weight"
    attr, _, part = stem.rpartition("_lora_")
    order = nesting[owner]
    return f"{owner}.{'base_layer.' * (len(order) - 1 - order.index(attr))}lora_{part}.weight"


def to_peft(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An adapter's whole tensor as PEFT lays it out: a linear layer's as it is; an experts parameter's [E, out, in]
    adapters as A [E*r, in] (expert e's rows together) and B [out, r*E] (its columns interleaved, `B[:, e::E]`)."""
    stem = name.rpartition(".")[2]
    if stem in DENSE_ADAPTERS:
        return tensor
    if stem.endswith("_lora_A"):
        return tensor.reshape(-1, tensor.shape[-1]).contiguous()
    return tensor.permute(1, 2, 0).reshape(tensor.shape[1], -1).contiguous()


def from_peft(name: str, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """`to_peft`'s inverse: PEFT's tensor for the adapter `name` of `shape` (parallelkit's)."""
    stem = name.rpartition(".")[2]
    if stem in DENSE_ADAPTERS:
        return tensor.reshape(shape)
    experts, rows, columns = shape
    if stem.endswith("_lora_A"):  # [E, r, in] from [E*r, in]
        return tensor.reshape(experts, rows, columns)
    return tensor.reshape(rows, columns, experts).permute(2, 0, 1)  # [E, out, r] from [out, r*E]


def peft_names(adapters: dict[str, torch.Tensor], targets: list[str] | str) -> dict[str, torch.Tensor]:
    """`adapters` (name -> whole tensor, parallelkit's names and shapes) under PEFT's names and in its layout
    (`peft_key`, `to_peft`)."""
    nesting = expert_targets(targets, list(adapters))
    return {peft_key(name, nesting): to_peft(name, tensor) for name, tensor in adapters.items()}


PEFT_PREFIX = "base_model.model."
"""Where a `peft.PeftModel` holds the transformers model: its adapter keys are `<prefix><module>.lora_A.weight`."""


def read_peft_adapters(
    directory: str | Path, model: nn.Module, targets: list[str] | str, rank: int, alpha: float
) -> None:
    """Set the adapters of `model` (a transformers model holding parallelkit's adapters of `rank` and `alpha` on
    `targets`) to those of the PEFT adapter directory `directory`, each rank its shards (`lora.init_from`). Read
    from safetensors and JSON only: nothing in the directory runs. Raises ConfigError for a directory whose rank or
    alpha differ, that lacks one of the adapters or holds others, or whose shapes differ, naming it."""
    from safetensors import safe_open

    directory = Path(directory)
    config_path, weights_path = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    for path in (config_path, weights_path):
        if not path.is_file():
            raise ConfigError(
                f"lora.init_from={directory}: no {path.name} there. Fix: a PEFT adapter directory (what export-hf "
                "--adapters or PeftModel.save_pretrained writes)."
            )
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"lora.init_from={directory}: {config_path.name} is not JSON ({err}).") from err
    theirs = config.get("r"), config.get("lora_alpha")
    if theirs != (rank, alpha):
        r, a = (f"{v:g}" if isinstance(v, (int, float)) else repr(v) for v in theirs)
        raise ConfigError(
            f"lora.init_from={directory}: its adapters have r={r}, lora_alpha={a}; this run's lora.rank={rank}, "
            f"lora.alpha={alpha:g}. Fix: the same rank and alpha as the adapters'."
        )
    params = {n: p for n, p in model.named_parameters() if n.rpartition(".")[2].endswith(DENSE_ADAPTERS)}
    nesting = expert_targets(targets, list(params))
    with safe_open(str(weights_path), framework="pt") as f:
        held = set(f.keys())
        wanted = {PEFT_PREFIX + peft_key(name, nesting): name for name in params}
        missing, extra = sorted(set(wanted) - held), sorted(held - set(wanted))
        if missing or extra:
            problem = f"has no {missing[0]}" if missing else f"holds {extra[0]}, which lora.targets does not adapt"
            raise ConfigError(
                f"lora.init_from={directory}: {weights_path.name} {problem} ({len(missing)} missing, {len(extra)} "
                f"more). Fix: lora.targets as the adapters were trained with (theirs: target_modules="
                f"{config.get('target_modules')}, target_parameters={config.get('target_parameters')})."
            )
        for key, name in wanted.items():
            param, tensor = params[name], f.get_tensor(key)
            expected = tuple(to_peft(name, torch.empty(param.shape, device="meta")).shape)
            if tuple(tensor.shape) != expected:
                raise ConfigError(
                    f"lora.init_from={directory}: {key} is {list(tensor.shape)}; {name} needs {list(expected)}. Fix: "
                    "adapters of this model (the same sizes and number of experts)."
                )
            with torch.no_grad():
                set_whole(param, from_peft(name, tensor, param.shape).to(param.device, param.dtype))
