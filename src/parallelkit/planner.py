"""The planner: per-device memory, communication and step time of every mesh, estimated from the model itself.

The model is built on the meta device (no memory) and run forward once on a meta batch of one sample, with the
saved-tensor ledger attributing the bytes autograd keeps to each pipeline layer; parameter counts, which of them
tensor parallelism shards, and what tensor parallelism gathers come from the model's own `tp_plan`. Everything
else is arithmetic on those counts, so a 70B configuration plans as fast as a toy one.

Per rank (the most loaded pipeline stage), in bytes:
- state: parameters (fp32), gradients (fp32), optimizer states (fp32; AdamW 2, SGD with momentum 1, SGD 0 per
  parameter), each `(tp-sharded / tp + replicated) / fsdp`; gradients and optimizer states of the trainable
  parameters only (a LoRA model's adapters);
- activations: the layers' saved bytes per sample x samples in flight (a pipeline stage holds GPipe: m, 1F1B:
  pp - stage, interleaved: its warm-up count of microbatch chunks); under tp, / tp plus what sequence
  parallelism gathers whole (the inputs of column-wise layers); under activation checkpointing, each checkpointed
  unit (all, or every n-th of a stage's, as the strategy picks them) keeps only its input, and the peak is the larger
  of the end of forward and a unit's recomputation in backward (what precedes it held, what follows it freed);
- gathered: FSDP's transient unsharded parameters, the root plus two units (the one running and the prefetch).
`tensor_peak` = state + activations is what `RankMonitor` measures on CPU; `peak` adds the gathered buffers.

Communication per optimizer step, logical bytes as `CommunicationMonitor` counts them: fsdp all-gathers
(forward, and backward for units resharded after forward) and the gradient reduce-scatter; HSDP's replicate
all-reduce; tp's activation collectives; pp's boundary activations and their gradients. The step time adds
compute (6 FLOPs per parameter per token plus attention, at `mfu` of the device's peak, stretched by the
pipeline bubble; a checkpointed unit's forward runs twice, 8 FLOPs per parameter per token) to every axis's bytes
over its link bandwidth, with no overlap assumed. Layouts are ranked by job-wide tokens per second among those that
fit; `recommend(search=workloads(work))` also tries activation checkpointing (none, every 2nd unit, all) and every
micro-batch that divides the samples a process takes per optimizer step (the rest accumulated), keeping the global
batch.

Over 400 lines: one estimate of a step (the profile, the per-rank arithmetic, the candidate meshes, the
recommendation) whose parts read the same counts; apart, each would re-export the others' definitions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from parallelkit.compat import flash_attention_on_cpu
from parallelkit.contract import GATHERING_STYLES, SHARDING_STYLES
from parallelkit.errors import PlanError
from parallelkit.lora import WHOLE_UNDER, LoRALinear, wants_nf4
from parallelkit.mesh import MeshSpec
from parallelkit.parallel.resolve import expand_tp, gathered_inside, resolve, split_stages
from parallelkit.parallel.schedule import Schedule
from parallelkit.quantize import nf4_bytes

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd_momentum": 1, "sgd": 0}
"""fp32 states per parameter that each optimizer keeps."""


@dataclass(frozen=True)
class Hardware:
    """The machines: `device_memory` in bytes, link bandwidths in GB/s, peak dense TFLOP/s per device."""

    nodes: int
    devices_per_node: int
    device_memory: float
    intra_node_gbps: float = 200.0
    inter_node_gbps: float = 25.0
    device_tflops: float = 400.0
    mfu: float = 0.4

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(frozen=True)
class Workload:
    """What one step does: `micro_batch` samples of `seq_len` tokens per process (data.batch_size)."""

    seq_len: int
    micro_batch: int
    optimizer: str = "adamw"
    compute_bytes: int = 4  # 2 under bf16-mixed: activations and gathered parameters in bf16
    activation_checkpointing: str | int = "none"
    """The strategy's option: "none", "full" (every unit) or n (every n-th unit of each stage)."""
    accumulate: int = 1

    @property
    def checkpoint_every(self) -> int:
        """Every how many units activation checkpointing recomputes one; 0 for none."""
        policy = self.activation_checkpointing
        return 0 if policy == "none" else 1 if policy == "full" else int(policy)


def workload(
    datamodule: Any,
    precision: str,
    activation_checkpointing: int | str | None,
    accumulate: int = 1,
    *,
    seq_len: int | None = None,
    micro_batch: int | None = None,
    optimizer: str = "adamw",
) -> Workload | None:
    """The workload of a run, as `fit` would run it: the datamodule's `seq_len` and `batch_size` (unless given), the
    trainer's precision (bf16: 2-byte activations) and accumulation, the strategy's activation checkpointing. None
    when the sequence length or the micro-batch is unknown. The `plan` tool and `mesh_shape="auto"` both use it."""
    seq_len = seq_len or getattr(datamodule, "seq_len", None)
    micro_batch = micro_batch or getattr(datamodule, "batch_size", None)
    if not seq_len or not micro_batch:
        return None
    return Workload(
        seq_len=seq_len,
        micro_batch=micro_batch,
        optimizer=optimizer,
        compute_bytes=2 if str(precision).startswith("bf16") else 4,
        activation_checkpointing=activation_checkpointing if activation_checkpointing not in (0, None) else "none",
        accumulate=accumulate,
    )


@dataclass
class Layer:
    """One pipeline layer, counted on the meta device (activation figures per sample at the workload's seq_len)."""

    name: str
    params: int
    tp_sharded: int
    activations: float
    gathered_inputs: float
    tp_traffic: float
    output: float
    unit: bool
    trainable: int
    """Parameters that get gradients (all but a LoRA model's frozen base); `tp_trainable` of them are tp-sharded."""
    tp_trainable: int
    experts: int = 0
    """Parameters of its experts modules (divided over an ep axis instead of gathered whole over it)."""
    trainable_experts: int = 0
    routed: float = 0.0
    """Bytes per sample of the token copies its experts modules are sent (tokens x top-k x hidden, fp32)."""
    quantized: int = 0
    """Parameters stored as NF4 (QLoRA's base weights), held, gathered and sent as `quantized_bytes` in all."""
    quantized_bytes: float = 0.0


@dataclass
class ModelProfile:
    name: str
    layers: list[Layer]
    loss_activations: float
    flops_per_token: float
    valid_tp: dict[int, str] = field(default_factory=dict)
    """tp degree -> "" when the model's plan allows it, else the reason."""
    num_experts: int = 0
    """Experts per mixture-of-experts layer (the fewest of any), 0 for a dense model: ep must divide it."""

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)


@dataclass
class Estimate:
    mesh: str
    schedule: str | None
    params: float
    grads: float
    optimizer: float
    activations: float
    gathered: float
    comm: dict[str, float]
    step_s: float
    tokens_per_s: float = 0.0
    """Job-wide: every data-parallel replica's tokens per estimated step time (what layouts compete on: at the
    same micro-batch per process, a layout with more replicas does more work per step)."""
    fits: bool = False
    activation_checkpointing: str | int = "none"
    micro_batch: int = 0
    """Samples per process per forward (data.batch_size); `accumulate` of them per optimizer step."""
    accumulate: int = 1

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def tensor_peak(self) -> float:
        return self.state + self.activations

    @property
    def peak(self) -> float:
        return self.tensor_peak + self.gathered

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state, "tensor_peak": self.tensor_peak, "peak": self.peak}


_GROUPED_MM = (getattr(torch.nn.functional, "grouped_mm", None), getattr(torch, "_grouped_mm", None))


class _MetaForward(torch.overrides.TorchFunctionMode):
    """What a meta forward needs to count what a real one keeps.

    Meta tensors pick SDPA's math path, which keeps the T x T attention matrix; real runs use a flash kernel that
    keeps q, k, v, the output and the log-sum-exp: attention is run as that kernel (grouped-query key/value heads
    repeated, as the kernel takes them). An experts module's grouped GEMM, whose meta kernel takes bf16 only, runs as
    one matrix multiply of the same shapes, and its count of tokens per expert (a value) is zeros. And a meta tensor
    has no value to branch on: model code that asks one for a truth value (transformers checks whether positions
    restart, i.e. sequences are packed) is told "true", the unpacked, unpadded case of a training batch of full
    windows."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__bool__ and args[0].is_meta:
            return True
        if func is torch.bincount and args[0].is_meta:  # counts of routed tokens: their sizes, not their values
            return torch.zeros(max(kwargs.get("minlength", 0), 1), dtype=torch.int64, device="meta")
        if func in _GROUPED_MM and args[0].is_meta:
            # Experts' grouped GEMM, whose meta kernel takes bf16 only: the same output shape and saved input.
            return torch.matmul(args[0], args[1][0])
        if func is torch.nn.functional.scaled_dot_product_attention and kwargs.get("attn_mask") is None:
            q, k, v = args[:3]
            if k.shape[-3] != q.shape[-3]:  # grouped-query attention
                k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], dim=-3) for t in (k, v))
            return flash_attention_on_cpu(q, k, v, bool(kwargs.get("is_causal", False)), kwargs.get("scale"))
        return func(*args, **kwargs)


def _nbytes(x: Any) -> float:
    if isinstance(x, torch.Tensor):
        return float(x.numel() * x.element_size())
    if isinstance(x, (tuple, list)):
        return sum(_nbytes(v) for v in x)
    return 0.0


def profile(
    model: nn.Module, seq_len: int, tp_degrees: Iterable[int] = (1,), vocab_size: int | None = None
) -> ModelProfile:
    """Count `model` (on the meta device) per pipeline layer, running one meta forward of one sample."""
    from parallelkit.callbacks.activations import _SavedTensorLedger

    resolved = resolve(model)
    plan = resolved.plan
    names = list(resolved.pipeline_layers)  # none when not pipelinable (e.g. tied embeddings): no pipeline layout
    units = set(resolved.fsdp_units)
    experts = [model.get_submodule(name) for name in resolved.experts]
    expert_params = {id(p) for module in experts for p in module.parameters()}
    sharded: set[int] = set()
    tp_modules: list[tuple[nn.Module, str]] = []
    styles = expand_tp(model, plan) if plan.tp else {}
    gathering = gathered_inside(styles)
    for fqn, style in styles.items():
        module = model.get_submodule(fqn)
        if style in SHARDING_STYLES:
            whole = WHOLE_UNDER.get(style) if isinstance(module, LoRALinear) else None
            sharded.update(id(p) for name, p in module.named_parameters() if name != whole)
        if (style in SHARDING_STYLES or style in GATHERING_STYLES) and fqn not in gathering:
            tp_modules.append((module, style))

    ledger = _SavedTensorLedger()
    marks: dict[str, list[float]] = {}
    gathered: dict[int, float] = {}
    scattered: dict[int, float] = {}
    routed: dict[int, float] = {}
    outputs: dict[str, float] = {}
    handles = []

    def enter(name: str) -> Any:
        return lambda module, args: marks.__setitem__(name, [ledger.live])

    def leave(name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            marks[name].append(ledger.live)
            outputs[name] = _nbytes(output)

        return hook

    def record(into: dict[int, float], what: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any = None) -> None:
            into[id(module)] = _nbytes(args if what == "input" else output)

        return hook

    for name in names:
        layer = model.get_submodule(name)
        handles += [layer.register_forward_pre_hook(enter(name)), layer.register_forward_hook(leave(name))]

    def copies(module: nn.Module, args: Any) -> None:  # (tokens [N, H], top_k_index [N, k], ...)
        tokens, index = args[0], args[1]
        routed[id(module)] = float(tokens.shape[0] * index.shape[-1] * tokens.shape[-1] * 4)

    handles += [module.register_forward_pre_hook(copies) for module in experts]
    for module, style in tp_modules:
        # Sequence parallelism all-gathers a column-wise layer's input (which autograd then keeps whole), once for
        # all of them in a gather_input module, and reduce-scatters a row-wise layer's output.
        if style in GATHERING_STYLES:
            handles.append(module.register_forward_pre_hook(record(gathered, "input")))
        else:
            handles.append(module.register_forward_hook(record(scattered, "output")))
    embeddings = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab = vocab_size or (embeddings[0] if embeddings else 2)
    tokens = torch.randint(0, vocab, (1, seq_len), device="meta")
    try:
        with torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack), _MetaForward():
            output = model(tokens)
            before_loss = ledger.live
            if plan.loss is not None:
                plan.loss(output, tokens)
    finally:
        for handle in handles:
            handle.remove()
    loss_activations = ledger.live - before_loss

    layers = []
    for name in names or [""]:
        module = model.get_submodule(name) if name else model
        members = {id(m) for m in module.modules()}
        params = list(module.parameters())
        start, end = marks.get(name, [0.0, before_loss])[:2] if name else (0.0, before_loss)
        layers.append(
            Layer(
                name=name or type(model).__name__,
                params=sum(p.numel() for p in params),
                tp_sharded=sum(p.numel() for p in params if id(p) in sharded),
                activations=end - start,
                gathered_inputs=sum(v for k, v in gathered.items() if k in members),
                tp_traffic=sum(v for k, v in (*gathered.items(), *scattered.items()) if k in members),
                output=outputs.get(name, 0.0),
                unit=name in units,
                trainable=sum(p.numel() for p in params if p.requires_grad),
                tp_trainable=sum(p.numel() for p in params if p.requires_grad and id(p) in sharded),
                experts=sum(p.numel() for p in params if id(p) in expert_params),
                trainable_experts=sum(p.numel() for p in params if p.requires_grad and id(p) in expert_params),
                routed=sum(v for k, v in routed.items() if k in members),
                quantized=sum(m.weight.numel() for m in module.modules() if wants_nf4(m)),
                quantized_bytes=sum(nf4_bytes(m.weight.numel()) for m in module.modules() if wants_nf4(m)),
            )
        )
    valid: dict[int, str] = {}
    for tp in tp_degrees:
        try:
            if tp > 1:
                resolve(model, tp=tp, plan=plan)
            valid[tp] = ""
        except PlanError as err:
            valid[tp] = str(err)
    flops = plan.flops_per_token
    flops_per_token = flops(seq_len) if flops is not None else 6.0 * sum(layer.params for layer in layers)
    fewest = min((module.num_experts for module in experts), default=0)
    return ModelProfile(plan.description, layers, loss_activations, flops_per_token, valid, fewest)


def _in_flight(schedule: str | None, pp: int, stage: int, microbatches: int, virtual: int) -> float:
    """Microbatches' worth of this stage's activations alive at once (a fraction for interleaved chunks)."""
    match schedule:
        case None:
            return 1.0
        case "gpipe":
            return float(microbatches)
        case "1f1b":
            return float(min(microbatches, pp - stage))
        case "interleaved_1f1b":
            chunks = min(microbatches * virtual, (pp - 1 - stage) * 2 + (virtual - 1) * pp + 1)
            return chunks / virtual
    raise PlanError(f"unknown schedule {schedule!r}")


def estimate(
    prof: ModelProfile,
    spec: MeshSpec,
    work: Workload,
    hw: Hardware,
    schedule: str | None = None,
    microbatches: int | None = None,
    stages: list[list[Layer]] | None = None,
) -> Estimate:
    """Per-device memory, communication and step time of `spec` (resolved) for this workload: the figures of
    its most loaded rank. `stages`: the pipeline stages in order (pp x virtual of them; rank r holds stages
    r, r + pp, ...)."""
    pp, rep, fsdp, ep, tp = (spec.size(a) for a in ("pp", "replicate", "fsdp", "ep", "tp"))
    sharding = fsdp * ep  # dense parameters are sharded over fsdp x ep; experts divided over ep, sharded over fsdp
    stages = stages or [prof.layers]
    v = len(stages) // pp
    m = microbatches or (Schedule(schedule or "1f1b", pp, v).microbatches if pp > 1 else 1)  # PipelineStrategy's
    samples = work.micro_batch / (m if pp > 1 else 1)
    cb = work.compute_bytes / 4  # the ledger counted fp32 activations
    states = OPTIMIZER_STATES[work.optimizer]

    def local_params(layers: Iterable[Layer]) -> float:
        return sum(layer.tp_sharded / tp + layer.params - layer.tp_sharded for layer in layers)

    def local_trainable(layers: Iterable[Layer]) -> float:
        return sum(layer.tp_trainable / tp + layer.trainable - layer.tp_trainable for layer in layers)

    def whole(layers: Iterable[Layer]) -> float:
        """What FSDP gathers of `layers` on a rank: dense parameters whole, experts this rank's ep share."""
        return sum(local_params([layer]) - layer.experts * (1 - 1 / ep) for layer in layers)

    def in_bytes(layers: Iterable[Layer], counted: Callable[[Layer], float], width: float) -> float:
        """`counted(layer)` parameters in bytes, `width` each, but NF4 weights at their own size (tp is 1 with them)."""
        return sum((counted(layer) - layer.quantized) * width + layer.quantized_bytes for layer in layers)

    def gathered_bytes(layers: Iterable[Layer]) -> float:
        return in_bytes(layers, lambda layer: whole([layer]), work.compute_bytes)

    def held(layer: Layer) -> float:
        """What a sample's forward through `layer` keeps for backward, per rank."""
        if tp == 1:
            return layer.activations * cb
        return layer.activations * cb / tp + layer.gathered_inputs * cb * (1 - 1 / tp)

    def checkpointed(stage: list[Layer]) -> list[Layer]:
        """The units activation checkpointing recomputes, counted per stage as `parallelize` counts them."""
        every = work.checkpoint_every
        return [unit for i, unit in enumerate(layer for layer in stage if layer.unit) if every and i % every == 0]

    policy = work.activation_checkpointing
    worst: Estimate | None = None
    slowest = 0.0
    for rank in range(pp):
        mine = [(i, stage) for i, stage in enumerate(stages) if i % pp == rank]
        layers = [layer for _, stage in mine for layer in stage]
        recomputed = [layer for _, stage in mine for layer in checkpointed(stage)]
        kept_input = {layer.name for layer in recomputed}  # only the unit's input (the previous unit's output)
        param_bytes = in_bytes(layers, lambda layer: local_params([layer]), 4) / sharding
        trained = local_trainable(layers)  # of tp_params: what has gradients and optimizer state
        reduced = trained - sum(layer.trainable_experts for layer in layers) * (1 - 1 / ep)  # experts: over fsdp
        in_flight = _in_flight(schedule if pp > 1 else None, pp, rank, m, v)
        kept = [layer.output * cb / tp if layer.name in kept_input else held(layer) for layer in layers]
        per_sample = sum(kept)
        acts = per_sample * in_flight * samples  # at the end of forward
        if any(i == len(stages) - 1 for i, _ in mine):
            acts += prof.loss_activations * cb * samples
        before = 0.0
        for layer, holds in zip(layers, kept):
            if layer.name in kept_input:  # recomputed in backward: what comes after it is freed by then
                acts = max(acts, (per_sample * (in_flight - 1) + before + held(layer)) * samples)
            before += holds
        units = [gathered_bytes([layer]) for layer in layers if layer.unit]
        all_gathered = gathered_bytes(layers)
        gathered = 0.0
        if sharding > 1:
            gathered = all_gathered - sum(units) + 2 * max(units, default=0.0)
        comm: dict[str, float] = {}
        if sharding > 1:
            # Default resharding re-gathers every unit but the last in backward; pipelines keep them gathered.
            regathered = 0.0 if pp > 1 else sum(units[:-1])
            axis = "fsdp" if fsdp > 1 else "ep"
            comm[axis] = (all_gathered + regathered) * work.accumulate + reduced * 4
        if ep > 1:  # the token copies to their experts and back, in forward and backward
            copies = sum(layer.routed for layer in layers) * cb * work.micro_batch * work.accumulate
            comm["ep"] = comm.get("ep", 0.0) + 4 * copies
        if rep > 1:
            comm["replicate"] = trained / sharding * 4
        if tp > 1:
            comm["tp"] = 2 * sum(layer.tp_traffic for layer in layers) * cb * work.micro_batch * work.accumulate
        if pp > 1:
            sent = sum(stage[-1].output for i, stage in mine if i < len(stages) - 1)
            comm["pp"] = 2 * sent * cb * work.micro_batch * work.accumulate
        tokens = work.micro_batch * work.seq_len * work.accumulate
        share = sum(layer.params for layer in layers) / max(prof.params, 1)
        compute = prof.flops_per_token * share * tokens / tp / (hw.device_tflops * 1e12 * hw.mfu)
        # A recomputed unit's forward runs again in backward: a third more of its share of the stage's work.
        compute *= 1 + sum(layer.params for layer in recomputed) / max(sum(layer.params for layer in layers), 1) / 3
        if pp > 1:
            compute /= 1 - (pp - 1) / (v * m + pp - 1)
        seconds = compute + sum(b / (_bandwidth(spec, axis, hw) * 1e9) for axis, b in comm.items())
        slowest = max(slowest, seconds)
        grads = trained / sharding * 4
        e = Estimate(str(spec), schedule, param_bytes, grads, grads * states, acts, gathered, comm, seconds)
        e.activation_checkpointing, e.micro_batch, e.accumulate = policy, work.micro_batch, work.accumulate
        if worst is None or e.peak > worst.peak:
            worst = e
    worst.step_s = slowest
    worst.tokens_per_s = work.micro_batch * work.seq_len * work.accumulate * rep * sharding / slowest
    worst.fits = worst.peak <= hw.device_memory
    return worst


def _bandwidth(spec: MeshSpec, axis: str, hw: Hardware) -> float:
    """GB/s of `axis`: inside a node when the axis and every axis inside it fit in one node's devices."""
    inner = math.prod(spec.sizes[spec.names.index(axis) :])
    return hw.intra_node_gbps if inner <= hw.devices_per_node else hw.inter_node_gbps


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    prof: ModelProfile, hw: Hardware, work: Workload, pipeline: bool = True
) -> list[tuple[MeshSpec, str | None]]:
    """Every mesh (and pipeline schedule) the model and the machines allow: tp inside a node and allowed by the
    model's plan, pp no deeper than its pipeline layers with whole microbatches, the rest fsdp, or HSDP (shard
    within a node, replicate across nodes); for a mixture-of-experts model, part of the sharded axis as ep (dividing
    its experts, ep x tp inside a node)."""
    found: list[tuple[MeshSpec, str | None]] = []
    world = hw.world_size
    for tp in _divisors(hw.devices_per_node):
        if prof.valid_tp.get(tp, "") != "":
            continue
        for pp in _divisors(world // tp) if pipeline else [1]:
            if pp > 1 and (
                len(prof.layers) < pp or work.micro_batch % min(2 * pp, work.micro_batch) or work.micro_batch < pp
            ):
                continue
            dp = world // (tp * pp)
            layouts = [(1, dp)]
            per_node = hw.devices_per_node // tp if pp == 1 else 0
            if hw.nodes > 1 and per_node and dp % per_node == 0 and dp // per_node > 1:
                layouts.append((dp // per_node, per_node))
            # Expert parallelism takes part of the sharded axis: ep divides the experts and, with tp, stays in a node.
            splits = [
                (rep, fsdp // ep, ep)
                for rep, fsdp in layouts
                for ep in _divisors(fsdp)
                if ep == 1 or (prof.num_experts and prof.num_experts % ep == 0 and ep * tp <= hw.devices_per_node)
            ]
            for rep, fsdp, ep in splits:
                sizes = [s for s in (pp, rep, fsdp, ep, tp)]
                names = ["pp", "replicate", "fsdp", "ep", "tp"]
                keep = [i for i, (s, n) in enumerate(zip(sizes, names)) if s > 1 or n in ("fsdp", "tp")]
                spec = MeshSpec(tuple(sizes[i] for i in keep), tuple(names[i] for i in keep))
                for schedule in ["1f1b", "interleaved_1f1b"] if pp > 1 else [None]:
                    if schedule == "interleaved_1f1b" and len(prof.layers) < 2 * pp:
                        continue
                    if pp > 1 and work.micro_batch % min(Schedule(schedule, pp).microbatches, work.micro_batch):
                        continue  # PipelineStrategy's default microbatches would not split the micro-batch
                    found.append((spec, schedule))
    return found


def estimate_layout(
    model: nn.Module,
    prof: ModelProfile,
    spec: MeshSpec,
    schedule: str | None,
    work: Workload,
    hw: Hardware,
    stages_per_rank: int | None = None,
    microbatches: int | None = None,
    split: Callable[[int], list[list[str]]] | None = None,
) -> Estimate:
    """`estimate` of one layout of `model` (profiled as `prof`): its pipeline stages split as PipelineStrategy splits
    them (`stages_per_rank`: 2 for interleaved_1f1b unless given), its micro-batches PipelineStrategy's default.
    `split(n)`: the layers' names in n stages, when the caller keeps them (else split here)."""
    pp = spec.size("pp")
    if pp == 1:
        return estimate(prof, spec, work, hw, schedule)
    v = stages_per_rank or (2 if schedule == "interleaved_1f1b" else 1)
    by_name = {layer.name: layer for layer in prof.layers}
    names = (split or (lambda n: split_stages(model, [layer.name for layer in prof.layers], n)))(pp * v)
    stages = [[by_name[n] for n in stage] for stage in names]
    m = microbatches or min(Schedule(schedule, pp, v).microbatches, work.micro_batch)
    return estimate(prof, spec, work, hw, schedule, m, stages)


CHECKPOINTING_SEARCHED: tuple[str | int, ...] = ("none", 2, "full")
"""The activation checkpointing `workloads` tries: none, every 2nd unit, every unit."""


def workloads(work: Workload, checkpointing: bool = True, micro_batch: bool = True) -> list[Workload]:
    """`work` with each activation checkpointing of CHECKPOINTING_SEARCHED (`checkpointing`) and each micro-batch that
    divides the samples a process takes per optimizer step, the rest accumulated (`micro_batch`): the same global
    batch, so the same training, at another memory and speed."""
    samples = work.micro_batch * work.accumulate
    policies = [work.activation_checkpointing, *(CHECKPOINTING_SEARCHED if checkpointing else ())]
    batches = _divisors(samples) if micro_batch else [work.micro_batch]
    return [
        replace(work, activation_checkpointing=policy, micro_batch=mb, accumulate=samples // mb)
        for policy in dict.fromkeys(policies)
        for mb in batches
    ]


def _ranking(e: Estimate) -> tuple[bool, float, float]:
    return (not e.fits, -e.tokens_per_s, e.peak)


def recommend(
    model: nn.Module,
    work: Workload,
    hw: Hardware,
    pipeline: bool = True,
    search: Sequence[Workload] | None = None,
) -> tuple[list[Estimate], Estimate | None, str]:
    """Every candidate layout's estimate (best first), the recommended one (None when none fits), and the one-line
    reason. `search`: the workloads to try each layout with (`workloads(work)`); a layout's row is then its fastest
    fitting one (else its smallest)."""
    prof = profile(model, work.seq_len, _divisors(hw.devices_per_node))
    split = functools.cache(lambda n: split_stages(model, [layer.name for layer in prof.layers], n))
    by_layout: dict[tuple[str, str | None], list[Estimate]] = {}
    for tried in search or [work]:
        for spec, schedule in candidates(prof, hw, tried, pipeline):
            e = estimate_layout(model, prof, spec, schedule, tried, hw, split=split)
            by_layout.setdefault((e.mesh, e.schedule), []).append(e)
    estimates = [
        min(tried, key=_ranking) if any(e.fits for e in tried) else min(tried, key=lambda e: e.peak)
        for tried in by_layout.values()
    ]
    estimates.sort(key=_ranking)
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        best = min(estimates, key=lambda e: e.peak)
        over = best.peak - hw.device_memory
        searched = "" if search is None else " (activation checkpointing and micro-batch searched)"
        return (
            estimates,
            None,
            (
                f"no layout fits{searched}: the smallest per-device peak is {gb(best.peak)} ({layout(best)}), "
                f"{gb(over)} over the {gb(hw.device_memory)} device ({best.peak / hw.device_memory:.2f}x). Fix: more "
                "devices, "
                + ("" if search else "activation checkpointing, a smaller micro-batch, ")
                + "a shorter sequence, or a smaller model."
            ),
        )
    best = fitting[0]
    reason = f"fits in {gb(best.peak)} of {gb(hw.device_memory)} per device with the highest estimated throughput"
    reason += f" ({best.tokens_per_s:,.0f} tokens/s"
    reason += f" vs {fitting[1].tokens_per_s:,.0f} for {layout(fitting[1])})" if len(fitting) > 1 else ")"
    return estimates, best, reason


def layout(e: Estimate) -> str:
    """The layout and the settings it was estimated with, as a config says them."""
    settings = [e.mesh, *([e.schedule] if e.schedule else [])]
    settings.append(f"activation_checkpointing={e.activation_checkpointing}")
    settings.append(
        f"batch_size={e.micro_batch}" + (f" x accumulate_grad_batches={e.accumulate}" if e.accumulate > 1 else "")
    )
    return ", ".join(settings)


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"
