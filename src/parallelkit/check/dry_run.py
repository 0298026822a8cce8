"""`parallelkit check --dry-run`: a layout for a cluster you do not have, validated by the code that will run it.

In one process, for a chosen rank (or each), torch's fake process group stands in for the job's: the strategy's
own mesh is built (every group, no connection), and the strategy's own plan (`parallelkit.parallelize`: pipeline
split, tensor and expert parallelism, FSDP) is applied to the run's model on the meta device, so divisibility, the
stage split and every shape come from the real code path, and nothing is allocated. Each rank's local parameter,
gradient and optimizer bytes are then summed from the shards it holds, beside the planner's estimate for the same
layout (`parallelkit.planner.estimate_layout`).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from parallelkit.errors import ConfigError
from parallelkit.memory import gb, local_bytes
from parallelkit.planner import OPTIMIZER_STATES


@dataclass
class RankState:
    """What one rank holds once the plan is applied: bytes of its local shards."""

    rank: int
    coordinates: dict[str, int]
    stages: list[int] | None
    params: int
    trainable: int
    grads: int
    optimizer: int

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer


def build_rank(strategy: Any, template: torch.nn.Module, rank: int, optimizer: str = "adamw") -> RankState:
    """Apply `strategy`'s plan to a copy of the meta model `template` as global `rank` would, and measure it."""
    from parallelkit.compat import fake_process_group, set_device_mesh
    from parallelkit.parallel import parallelize
    from parallelkit.strategies.pipeline import PipelineStrategy

    spec = strategy.mesh_spec
    model = copy.deepcopy(template)
    with fake_process_group(rank, spec.world_size):
        mesh = spec.build("cpu")
        strategy.connect(model)
        set_device_mesh(strategy, mesh)
        strategy.resolved = strategy.resolve_plan(model)
        options = {**strategy.parallelize_options(), "compile": None}  # compiling changes no byte
        stages = None
        if isinstance(strategy, PipelineStrategy):
            stages = list(strategy.pipeline.stage_indices(mesh["pp"].get_local_rank()))
        roots = parallelize(model, mesh, stages=stages, **options)
        params = {id(p): p for root in roots for p in root.parameters()}.values()
        trainable = [p for p in params if p.requires_grad]
        # Gradients as the parameters' own shards; the optimizer's moments in fp32 (AdamW: two per element).
        moments = OPTIMIZER_STATES[optimizer] * sum(local_bytes(p) // p.element_size() * 4 for p in trainable)
        return RankState(
            rank,
            spec.coordinates(rank),
            stages,
            sum(local_bytes(p) for p in params),
            sum(local_bytes(p) for p in trainable),
            sum(local_bytes(p) for p in trainable),
            int(moments),
        )


def ranks_of(text: str, world_size: int) -> list[int]:
    if text == "all":
        return list(range(world_size))
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        ranks = [-1]
    if any(not 0 <= r < world_size for r in ranks):
        raise ConfigError(
            f"--rank {text}: ranks are 0..{world_size - 1} on this layout. Fix: one rank, a comma-separated list, or "
            "'all' (each rank built in turn)."
        )
    return ranks


def dry_run(
    trainer: Any,
    model: Any,
    datamodule: Any,
    ranks: str = "0",
    as_json: bool = False,
    device_memory: float | None = None,
    memory_headroom: float | None = None,
) -> int:
    """Build `ranks` ("all", or comma-separated) of the run `trainer` (its strategy, devices and nodes as the cluster's)
    would launch, in this process; print each rank's bytes beside the planner's estimate, and with `device_memory`
    (bytes per device) whether the planner's peak fits it less the headroom `plan` and `mesh_shape: auto` keep
    (`memory_headroom`, a share; None: the planner's default)."""
    from parallelkit.planner import Hardware, estimate_layout, profile, workload
    from parallelkit.strategies import ParallelkitStrategy
    from parallelkit.strategies.pipeline import PipelineStrategy

    start = time.perf_counter()
    strategy = trainer.strategy
    if not isinstance(strategy, ParallelkitStrategy):
        raise ConfigError(
            f"--dry-run applies a parallelkit strategy's plan; this config's strategy is {type(strategy).__name__}, "
            "which shards nothing (a model preset names no strategy). Fix: name one, e.g. --trainer.strategy=fsdp_tp "
            "--trainer.strategy.mesh_shape=auto --device-memory 80GB (the layout the planner picks for such "
            "devices), or a mesh: --trainer.strategy.mesh_shape='[[8], [\"fsdp\"]]'."
        )
    strategy.check_run(model, datamodule, trainer.accumulate_grad_batches)
    spec = strategy.mesh_spec
    states = [build_rank(strategy, model, rank) for rank in ranks_of(ranks, spec.world_size)]
    seconds = time.perf_counter() - start

    precision, checkpointing = strategy.precision_plugin.precision, strategy.activation_checkpointing
    work = workload(datamodule, precision, checkpointing, cp_method=getattr(strategy, "cp_method", "allgather"))
    planned = None
    if work is not None:
        nodes, devices = trainer.num_nodes, trainer.num_devices
        headroom = {} if memory_headroom is None else {"memory_headroom": memory_headroom}
        hw = Hardware(nodes, devices, device_memory or float("inf"), **headroom)
        prof = profile(model, work.seq_len, [spec.size("tp")])
        pipeline = isinstance(strategy, PipelineStrategy)
        schedule = strategy.schedule if pipeline else None
        v = strategy.stages_per_rank if pipeline else None
        m = strategy.pipeline.microbatches if pipeline else None
        planned = estimate_layout(model, prof, spec, schedule, work, hw, v, m)

    if as_json:
        out = {
            "mesh": str(spec),
            "world_size": spec.world_size,
            "seconds": seconds,
            "ranks": [asdict(s) | {"state": s.state} for s in states],
            "planner": planned.as_dict() if planned else None,
        }
        print(json.dumps(out, indent=2))
        return 0
    name = type(model).__name__
    params = sum(p.numel() for p in model.parameters())
    table = Table(title=f"dry run: {name} ({params / 1e9:.2f}B parameters) on {spec} ({spec.world_size} ranks)")
    for column in ("rank", "coordinates", "stages", "params", "grads", "optimizer", "params+grads+optim"):
        table.add_column(column, justify="left" if column in ("coordinates", "stages") else "right")
    for s in states:
        coords = ", ".join(f"{k}={v}" for k, v in s.coordinates.items() if spec.size(k) > 1)
        stages = ", ".join(map(str, s.stages)) if s.stages is not None else "-"
        table.add_row(str(s.rank), coords, stages, gb(s.params), gb(s.grads), gb(s.optimizer), gb(s.state))
    console = Console(width=200)
    console.print(table)
    if planned is not None:
        most = max(states, key=lambda s: s.state)
        console.print(
            f"planner (the most loaded rank): params {gb(planned.params)}, params+grads+optim {gb(planned.state)}; "
            f"built here (rank {most.rank}): {gb(most.params)}, {gb(most.state)} "
            f"({most.state / planned.state:.3f}x)"
        )
        if device_memory is not None:
            verdict = "fits in" if planned.fits else "[red]does not fit[/] in"
            console.print(
                f"planner's peak {gb(planned.peak)} (activations and FSDP's buffers too) {verdict} the "
                f"{gb(hw.usable_memory)} usable of each {gb(device_memory)} device ({hw.memory_headroom:.0%} headroom)"
                + ("" if planned.fits else ". Fix: a layout or settings that fit: `parallelkit plan` lists them.")
            )
    console.print(f"{len(states)} rank(s) built in {seconds:.1f} s; the plan applies on {spec.world_size} ranks.")
    return 0
