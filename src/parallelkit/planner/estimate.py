"""The planner's arithmetic for one layout: per-rank memory, communication per axis and the step time, from a model's
profile (see the package docstring for each term)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from parallelkit.errors import PlanError
from parallelkit.mesh import MeshSpec
from parallelkit.parallel.schedule import Schedule
from parallelkit.planner.records import OPTIMIZER_STATES, Estimate, Hardware, Layer, ModelProfile, Workload


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
