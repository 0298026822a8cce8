"""The planner's search: the candidate layouts of a cluster, the workloads tried (activation checkpointing and
micro-batch), and the recommendation."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace

from torch import nn

from parallelkit.memory import gb
from parallelkit.mesh import MeshSpec
from parallelkit.parallel.resolve import split_stages
from parallelkit.parallel.schedule import Schedule
from parallelkit.planner.estimate import estimate
from parallelkit.planner.profile import profile
from parallelkit.planner.records import Estimate, Hardware, ModelProfile, Workload


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    prof: ModelProfile, hw: Hardware, work: Workload, pipeline: bool = True
) -> list[tuple[MeshSpec, str | None]]:
    """Every mesh (and pipeline schedule) the model and the machines allow: tp inside a node and allowed by the
    model's plan, pp no deeper than its pipeline layers with whole microbatches, the rest fsdp, or HSDP (shard
    within a node, replicate across nodes); for a mixture-of-experts model, part of the sharded axis as ep (dividing
    its experts, ep x tp inside a node); for a long sequence, part of it as cp (`_splits_sequence`, cp x ep x tp
    inside a node)."""
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
            # Context parallelism takes part of what remains (a long sequence's activations split), inside a node.
            splits = [
                (rep, fsdp // cp, ep, cp)
                for rep, fsdp, ep in splits
                for cp in _divisors(fsdp)
                if cp == 1 or _splits_sequence(prof, work, cp, tp) and cp * ep * tp <= hw.devices_per_node
            ]
            for rep, fsdp, ep, cp in splits:
                sizes = [s for s in (pp, rep, fsdp, ep, cp, tp)]
                names = ["pp", "replicate", "fsdp", "ep", "cp", "tp"]
                keep = [i for i, (s, n) in enumerate(zip(sizes, names)) if s > 1 or n in ("fsdp", "tp")]
                spec = MeshSpec(tuple(sizes[i] for i in keep), tuple(names[i] for i in keep))
                for schedule in ["1f1b", "interleaved_1f1b"] if pp > 1 else [None]:
                    if schedule == "interleaved_1f1b" and len(prof.layers) < 2 * pp:
                        continue
                    if pp > 1 and work.micro_batch % min(Schedule(schedule, pp).microbatches, work.micro_batch):
                        continue  # PipelineStrategy's default microbatches would not split the micro-batch
                    found.append((spec, schedule))
    return found


LONG_SEQUENCE = 8192
"""Tokens from which the planner also tries cp layouts: below, a sequence's activations rarely decide what fits, and
cp's attention traffic only slows the step."""


def _splits_sequence(prof: ModelProfile, work: Workload, cp: int, tp: int) -> bool:
    """Whether a cp axis of `cp` is a candidate: a long sequence (`LONG_SEQUENCE`) that 2 x cp divides, a model whose
    attention modules cp splits, and for Ulysses, heads per tp rank that cp divides."""
    if work.seq_len < LONG_SEQUENCE or work.seq_len % (2 * cp) or prof.attention_heads is None:
        return False
    heads, kv_heads = prof.attention_heads
    return work.cp_method != "ulysses" or (heads // tp) % cp == 0 and (kv_heads // tp) % cp == 0


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
    divides the samples a process takes per optimizer step, the rest accumulated (`micro_batch`; else `work`'s
    micro-batch, accumulated up to them): the same global batch, so the same training, at another memory and speed.

    A process takes `micro_batch x accumulate` samples a step; with `work.global_batch`, global_batch / dp on a layout
    of dp data-parallel ranks: every such share is tried, and `recommend` gives each layout those of its dp."""
    policies = [work.activation_checkpointing, *(CHECKPOINTING_SEARCHED if checkpointing else ())]
    if work.global_batch:
        shares = [work.global_batch // dp for dp in _divisors(work.global_batch)]
    else:
        shares = [work.micro_batch * work.accumulate]
    return [
        replace(work, activation_checkpointing=policy, micro_batch=mb, accumulate=samples // mb)
        for policy in dict.fromkeys(policies)
        for samples in shares
        for mb in (_divisors(samples) if micro_batch else [work.micro_batch] if samples % work.micro_batch == 0 else [])
    ]


def _ranking(e: Estimate) -> tuple[bool, float, float]:
    return (not e.fits, -e.tokens_per_s, e.peak)


def _estimates(
    model: nn.Module, prof: ModelProfile, hw: Hardware, pipeline: bool, search: Sequence[Workload]
) -> list[Estimate]:
    """Each candidate layout's estimate (best first) with the workloads of `search` it can take (those of its
    data-parallel size when they hold a global batch): its fastest fitting one, else its smallest."""
    split = functools.cache(lambda n: split_stages(model, [layer.name for layer in prof.layers], n))
    by_layout: dict[tuple[str, str | None], list[Estimate]] = {}
    for tried in search:
        for spec, schedule in candidates(prof, hw, tried, pipeline):
            if tried.global_batch and tried.micro_batch * tried.accumulate * spec.dp_size != tried.global_batch:
                continue  # another share of the global batch than this layout's data-parallel ranks take
            e = estimate_layout(model, prof, spec, schedule, tried, hw, split=split)
            by_layout.setdefault((e.mesh, e.schedule), []).append(e)
    estimates = [
        min(tried, key=_ranking) if any(e.fits for e in tried) else min(tried, key=lambda e: e.peak)
        for tried in by_layout.values()
    ]
    return sorted(estimates, key=_ranking)


def recommend(
    model: nn.Module,
    work: Workload,
    hw: Hardware,
    pipeline: bool = True,
    search: Sequence[Workload] | None = None,
) -> tuple[list[Estimate], Estimate | None, str]:
    """Every candidate layout's estimate (best first), the recommended one (None when none fits), and the one-line
    reason. `search`: the workloads to try each layout with (`workloads(work)`); a layout's row is then its fastest
    fitting one (else its smallest). Without it, `work` as it is (the micro-batch accumulated up to each layout's
    share of `work.global_batch`, when set); when no layout fits it so, the reason names the activation
    checkpointing and micro-batch of the best layout that `workloads(work)` finds fitting, as the settings to change."""
    prof = profile(model, work.seq_len, _divisors(hw.devices_per_node))
    estimates = _estimates(model, prof, hw, pipeline, search or workloads(work, checkpointing=False, micro_batch=False))
    fitting = [e for e in estimates if e.fits]
    budget = f"{gb(hw.usable_memory)} usable of each {gb(hw.device_memory)} device ({hw.memory_headroom:.0%} kept free)"
    if not estimates:
        return (
            estimates,
            None,
            f"no layout of {hw.nodes} x {hw.devices_per_node} devices takes a global batch of {work.global_batch} "
            "samples (none has data-parallel ranks that divide it). Fix: a global batch that the data-parallel ranks "
            "divide, e.g. a multiple of the devices.",
        )
    if not fitting:
        best = min(estimates, key=lambda e: e.peak)
        over = best.peak - hw.usable_memory
        searched = "" if search is None else " (activation checkpointing and micro-batch searched)"
        fix = "more devices, a shorter sequence, or a smaller model."
        if search is None:
            wider = [e for e in _estimates(model, prof, hw, pipeline, workloads(work)) if e.fits]
            fix = (
                f"{_settings(wider[0], work)} (it fits: {layout(wider[0])}, {gb(wider[0].peak)}); or " + fix
                if wider
                else fix[:-1] + " (activation checkpointing and a smaller micro-batch fit no layout either)."
            )
        return (
            estimates,
            None,
            f"no layout fits{searched}: the smallest per-device peak is {gb(best.peak)} ({layout(best)}), "
            f"{gb(over)} over the {budget} ({best.peak / hw.usable_memory:.2f}x). Fix: {fix}",
        )
    best = fitting[0]
    reason = f"fits in {gb(best.peak)} of the {budget} with the highest estimated throughput"
    reason += f" ({best.tokens_per_s:,.0f} tokens/s"
    reason += f" vs {fitting[1].tokens_per_s:,.0f} for {layout(fitting[1])})" if len(fitting) > 1 else ")"
    return estimates, best, reason


def _settings(e: Estimate, work: Workload) -> str:
    """The overrides that make a run of `work` take `e`'s activation checkpointing and micro-batch."""
    changed = []
    if e.activation_checkpointing != work.activation_checkpointing:
        changed.append(f"--trainer.strategy.activation_checkpointing={e.activation_checkpointing}")
    if e.micro_batch != work.micro_batch:
        changed.append(f"--data.init_args.batch_size={e.micro_batch}")
    if e.accumulate != work.accumulate:
        changed.append(f"--trainer.accumulate_grad_batches={e.accumulate}")
    return " ".join(changed)


def layout(e: Estimate) -> str:
    """The layout and the settings it was estimated with, as a config says them."""
    settings = [e.mesh, *([e.schedule] if e.schedule else [])]
    settings.append(f"activation_checkpointing={e.activation_checkpointing}")
    settings.append(
        f"batch_size={e.micro_batch}" + (f" x accumulate_grad_batches={e.accumulate}" if e.accumulate > 1 else "")
    )
    return ", ".join(settings)
