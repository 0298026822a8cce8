"""The planner's arithmetic for one layout: per-rank memory, communication per axis and the step time, from a model's
profile (see the package docstring for each term).

Each mesh axis has one function here (`_pp`, `_tp`, `_ep`, `_cp`, `_fsdp`, `_replicate`) that says what it does to a
rank's share of a step: what it divides (parameters, activations, compute) and what it adds (its traffic, gathered
buffers, microbatches in flight). `estimate` applies them in `AXIS_TERMS`' order, the order their terms build on
each other (FSDP shards what tensor, expert and context parallelism leave a rank; replicas all-reduce what FSDP
reduced), then adds up the share. A new axis is one function and its place in that order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from parallelkit.errors import PlanError
from parallelkit.mesh import MeshSpec
from parallelkit.parallel.schedule import Schedule
from parallelkit.planner.records import OPTIMIZER_STATES, Estimate, Hardware, Layer, ModelProfile, Workload


@dataclass
class _Share:
    """One pipeline rank's share of a step, as the axis functions leave it, each amending it in turn. Counts are
    elements per layer of `layers` unless said; activations are bytes per sample."""

    prof: ModelProfile
    spec: MeshSpec
    work: Workload
    rank: int
    """This rank's place on the pp axis."""
    stages: list[tuple[int, list[Layer]]]
    """This rank's stages, with their indices."""
    layers: list[Layer]
    """Their layers, in order."""
    recomputed: list[Layer]
    """The units activation checkpointing recomputes, counted per stage as `parallelize` counts them."""
    num_stages: int
    """How many stages the model is cut into (pp x virtual)."""
    schedule: str | None
    """The pipeline schedule (None without pp)."""
    microbatches: int
    """Microbatches per forward (1 without pp)."""
    cb: float
    """Bytes of an activation element over 4 (the ledger counted fp32 activations)."""
    samples: float = 0.0
    """Samples per forward."""
    in_flight: float = 1.0
    """Microbatches' worth of activations alive at once."""
    loss: float = 0.0
    """The loss's activations per sample on this rank (those of the last stage)."""
    regathers: bool = True
    """FSDP gathers each unit again in backward (default resharding)."""
    bubble: float = 1.0
    """The fraction of the step this rank computes, the rest idle."""
    params: list[float] = field(default_factory=list)
    """Parameters of each layer on this rank, before FSDP shards them."""
    trained: float = 0.0
    """Parameters with gradients and optimizer states, before FSDP shards them."""
    held: list[float] = field(default_factory=list)
    """What a sample's forward through each layer keeps for backward."""
    kept: list[float] = field(default_factory=list)
    """The same, where a recomputed unit keeps only its input."""
    whole: list[float] = field(default_factory=list)
    """Parameters of each layer once FSDP gathers them: dense parameters whole, experts this rank's share."""
    reduced: float = 0.0
    """Trained parameters whose gradients FSDP reduces over its whole mesh."""
    shards: int = 1
    """Ranks that divide this share's parameters, gradients and optimizer states."""
    replicas: int = 1
    """Ranks that step on different data with the same parameters (fsdp shards, ep and replicate copies)."""
    compute_split: int = 1
    """Ranks that divide each token's compute."""
    gathered: float = 0.0
    """FSDP's transient unsharded parameters, in bytes."""
    comm: dict[str, float] = field(default_factory=dict)
    """Bytes per optimizer step, by axis."""


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


def _pp(share: _Share) -> None:
    """pp divides the layers into stages (`share.layers`) and each step into microbatches, several of them in flight
    at once as the schedule keeps them; it adds the stage boundaries' activations and their gradients, keeps FSDP's
    units gathered between microbatches, and idles each stage for the bubble."""
    pp, work, m = share.spec.size("pp"), share.work, share.microbatches
    v = share.num_stages // pp
    share.samples = work.micro_batch / (m if pp > 1 else 1)
    share.in_flight = _in_flight(share.schedule if pp > 1 else None, pp, share.rank, m, v)
    if any(i == share.num_stages - 1 for i, _ in share.stages):
        share.loss = share.prof.loss_activations * share.cb
    if pp > 1:
        share.regathers = False
        sent = sum(stage[-1].output for i, stage in share.stages if i < share.num_stages - 1)
        share.comm["pp"] = 2 * sent * share.cb * work.micro_batch * work.accumulate
        share.bubble = 1 - (pp - 1) / (v * m + pp - 1)


def _tp(share: _Share) -> None:
    """tp divides the parameters its plan shards, and each layer's activations but for the inputs sequence
    parallelism gathers whole, and each token's compute; it adds its activation collectives, forward and backward."""
    tp, work, cb = share.spec.size("tp"), share.work, share.cb
    share.params = [layer.tp_sharded / tp + layer.params - layer.tp_sharded for layer in share.layers]
    share.trained = sum(layer.tp_trainable / tp + layer.trainable - layer.tp_trainable for layer in share.layers)
    if tp == 1:
        share.held = [layer.activations * cb for layer in share.layers]
    else:
        share.held = [layer.activations * cb / tp + layer.gathered_inputs * cb * (1 - 1 / tp) for layer in share.layers]
    recomputed = {layer.name for layer in share.recomputed}  # keep only the unit's input (the previous unit's output)
    share.kept = [
        layer.output * cb / tp if layer.name in recomputed else held for layer, held in zip(share.layers, share.held)
    ]
    share.compute_split = tp
    if tp > 1:
        share.comm["tp"] = 2 * sum(layer.tp_traffic for layer in share.layers) * cb * work.micro_batch * work.accumulate


def _ep(share: _Share) -> None:
    """ep divides the experts over its ranks (FSDP gathers and reduces only this rank's), and shards the dense
    parameters with fsdp; it adds the token copies to their experts and back, forward and backward."""
    ep, work = share.spec.size("ep"), share.work
    share.whole = [params - layer.experts * (1 - 1 / ep) for params, layer in zip(share.params, share.layers)]
    share.reduced = share.trained - sum(layer.trainable_experts for layer in share.layers) * (1 - 1 / ep)
    share.shards *= ep
    share.replicas *= ep
    if ep > 1:
        copies = sum(layer.routed for layer in share.layers) * share.cb * work.micro_batch * work.accumulate
        share.comm["ep"] = share.comm.get("ep", 0.0) + 4 * copies


def _cp(share: _Share) -> None:
    """cp splits every sequence over its ranks: it divides each layer's activations (and the loss's) and each sample's
    compute, and, data-parallel for the parameters, shards them with fsdp; it adds its attention traffic, forward and
    backward: the all-gather of keys and values (their gradients sent back), or Ulysses' all-to-alls of queries,
    keys, values and outputs, a rank keeping 1/cp of what it sends."""
    cp, work = share.spec.size("cp"), share.work
    if cp == 1:
        return
    share.held = [held / cp for held in share.held]
    share.kept = [kept / cp for kept in share.kept]
    share.loss /= cp
    share.compute_split *= cp
    share.shards *= cp
    away = (cp - 1) / cp
    if work.cp_method == "ulysses":
        per_sample = sum(2 * layer.attention_q + layer.attention_kv for layer in share.layers) / cp
    else:
        per_sample = sum(layer.attention_kv for layer in share.layers)
    share.comm["cp"] = 2 * per_sample * away * share.cb * work.micro_batch * work.accumulate


def _fsdp(share: _Share) -> None:
    """fsdp shards the parameters, gradients and optimizer states, over fsdp x ep x cp (experts over fsdp alone); it
    adds the all-gathers (forward, and backward for units resharded after forward), the gradient reduce-scatter, and
    the gathered buffers: the root plus two units (the one running and the prefetch)."""
    fsdp, work = share.spec.size("fsdp"), share.work
    share.shards *= fsdp
    share.replicas *= fsdp
    if share.shards == 1:
        return
    gathered = _in_bytes(share.layers, share.whole, work.compute_bytes, share.spec.size("ep"))
    units = [each for each, layer in zip(gathered, share.layers) if layer.unit]
    share.gathered = sum(gathered) - sum(units) + 2 * max(units, default=0.0)
    regathered = sum(units[:-1]) if share.regathers else 0.0
    axis = next(axis for axis in ("fsdp", "ep", "cp") if share.spec.size(axis) > 1)
    traffic = (sum(gathered) + regathered) * work.accumulate + share.reduced * 4
    share.comm[axis] = share.comm.get(axis, 0.0) + traffic


def _replicate(share: _Share) -> None:
    """replicate copies the sharded model (HSDP); it adds the all-reduce of each rank's gradient shard."""
    rep = share.spec.size("replicate")
    share.replicas *= rep
    if rep > 1:
        share.comm["replicate"] = share.trained / share.shards * 4


def _muon(share: _Share) -> None:
    """With `--optimizer muon`, each matrix's update goes to its owner among the stage's ranks and its orthogonalised
    shards come back (`parallelkit.optimizers.muon`): per rank about its shard of every matrix sent in fp32 and
    received in bf16, and as much again for the matrices it owns; counted on the stage's outermost axis."""
    ranks = [axis for axis, size in zip(share.spec.names, share.spec.sizes) if axis != "pp" and size > 1]
    if share.work.optimizer == "muon" and ranks:
        traffic = 2 * 6 * share.trained * _matrix_share(share.layers) / share.shards
        share.comm[ranks[0]] = share.comm.get(ranks[0], 0.0) + traffic


def _matrix_share(layers: list[Layer]) -> float:
    """The fraction of the layers' trained parameters that are Muon's matrices."""
    return sum(layer.matrices for layer in layers) / max(sum(layer.trainable for layer in layers), 1)


AXIS_TERMS: tuple[Callable[[_Share], None], ...] = (_pp, _tp, _ep, _cp, _fsdp, _replicate, _muon)
"""Every axis's function (and the optimizer's exchange, on the axes they leave), in the order `estimate` applies
them: each reads what those before it left."""

LISTED = ("fsdp", "ep", "replicate", "tp", "pp", "cp")
"""The order an estimate lists (and adds up) the axes' traffic in; an axis not named here comes after them."""


def _in_bytes(layers: list[Layer], counts: list[float], width: float, ep: int = 1) -> list[float]:
    """`counts` parameters of each layer in bytes, `width` each, but NF4 weights at their own size (tp is 1 with
    them); `ep`: the counts hold 1 / ep of the experts, and so of their NF4 weights."""
    kept = 1 - 1 / ep
    return [
        (count - layer.quantized + layer.quantized_experts * kept) * width
        + layer.quantized_bytes
        - layer.quantized_experts_bytes * kept
        for count, layer in zip(counts, layers)
    ]


def _checkpointed(stage: list[Layer], every: int | None) -> list[Layer]:
    """The units activation checkpointing recomputes, counted per stage as `parallelize` counts them."""
    return [unit for i, unit in enumerate(layer for layer in stage if layer.unit) if every and i % every == 0]


def _activations(share: _Share) -> float:
    """The rank's activation peak: the end of forward, or a recomputed unit's recomputation in backward (what comes
    after it freed by then)."""
    per_sample = sum(share.kept)
    acts = per_sample * share.in_flight * share.samples
    acts += share.loss * share.samples
    recomputed = {layer.name for layer in share.recomputed}
    before = 0.0
    for layer, held, kept in zip(share.layers, share.held, share.kept):
        if layer.name in recomputed:
            acts = max(acts, (per_sample * (share.in_flight - 1) + before + held) * share.samples)
        before += kept
    return acts


def _estimate(share: _Share, hw: Hardware) -> Estimate:
    """The rank's memory, traffic and step time, from its share as the axes left it (`step_s`: this rank's)."""
    prof, spec, work, layers = share.prof, share.spec, share.work, share.layers
    param_bytes = sum(_in_bytes(layers, share.params, 4)) / share.shards
    if prof.reference == "copy":  # preference tuning's frozen reference: the same shards, nothing else
        param_bytes *= 2
    comm = {axis: share.comm[axis] for axis in sorted(share.comm, key=_listed)}
    tokens = work.micro_batch * work.seq_len * work.accumulate
    part = sum(layer.params for layer in layers) / max(prof.params, 1)
    compute = prof.flops_per_token * part * tokens / share.compute_split / (hw.device_tflops * 1e12 * hw.mfu)
    # A recomputed unit's forward runs again in backward: a third more of its share of the stage's work.
    recomputed = sum(layer.params for layer in share.recomputed)
    compute *= 1 + recomputed / max(sum(layer.params for layer in layers), 1) / 3
    if prof.reference in ("copy", "adapters"):  # the reference's forward: a third of a step's forward and backward
        compute *= 4 / 3
    compute /= share.bubble
    seconds = compute + sum(b / (_bandwidth(spec, axis, hw) * 1e9) for axis, b in comm.items())
    grads = share.trained / share.shards * 4
    states = OPTIMIZER_STATES[work.optimizer]
    if work.optimizer == "muon":  # one momentum buffer per matrix element, AdamW's two for the rest
        states -= _matrix_share(layers)
    return Estimate(
        str(spec),
        share.schedule,
        param_bytes,
        grads,
        grads * states,
        _activations(share),
        share.gathered,
        comm,
        seconds,
        activation_checkpointing=work.activation_checkpointing,
        micro_batch=work.micro_batch,
        accumulate=work.accumulate,
    )


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
    pp = spec.size("pp")
    stages = stages or [prof.layers]
    v = len(stages) // pp
    m = microbatches or (Schedule(schedule or "1f1b", pp, v).microbatches if pp > 1 else 1)  # PipelineStrategy's
    worst: Estimate | None = None
    slowest = 0.0
    for rank in range(pp):
        mine = [(i, stage) for i, stage in enumerate(stages) if i % pp == rank]
        share = _Share(
            prof,
            spec,
            work,
            rank,
            stages=mine,
            layers=[layer for _, stage in mine for layer in stage],
            recomputed=[layer for _, stage in mine for layer in _checkpointed(stage, work.checkpoint_every)],
            num_stages=len(stages),
            schedule=schedule,
            microbatches=m,
            cb=work.compute_bytes / 4,
        )
        for axis_terms in AXIS_TERMS:
            axis_terms(share)
        e = _estimate(share, hw)
        slowest = max(slowest, e.step_s)
        if worst is None or e.peak > worst.peak:
            worst = e
    worst.step_s = slowest
    worst.data_parallel = share.replicas
    worst.tokens_per_s = worst.global_batch * work.seq_len / slowest
    worst.fits = worst.peak <= hw.usable_memory
    return worst


def _listed(axis: str) -> int:
    return LISTED.index(axis) if axis in LISTED else len(LISTED)


def _bandwidth(spec: MeshSpec, axis: str, hw: Hardware) -> float:
    """GB/s of `axis`: inside a node when the axis and every axis inside it fit in one node's devices."""
    inner = math.prod(spec.sizes[spec.names.index(axis) :])
    return hw.intra_node_gbps if inner <= hw.devices_per_node else hw.inter_node_gbps
