"""`parallelkit check`: test a run's own layout on its own cluster before its hours of queue time are spent.

parallelkit check --config configs/hybrid.yaml [fit's overrides] [--deadline 60] [--json]
parallelkit check --dry-run --nodes 16 --devices-per-node 8 --config RUN.yaml [--rank 0]

The live check is launched as `fit` is (Lightning's launcher, torchrun, SLURM) and runs on every rank
(`parallelkit.check.live`): each rank's host, device and versions on rank 0 (a mixed cluster refused), then
all-reduce, all-gather and reduce-scatter (all-to-all on ep, send/recv between pipeline stages) over every group of
every mesh axis at a few sizes, each call with a deadline, the slowest group and a rank that stops answering named.
The dry run (`parallelkit.check.dry_run`) builds the mesh with a fake process group in one process and applies the
run's real plan to its model on the meta device, for a cluster this machine need not be.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from parallelkit.check.collectives import size_text
from parallelkit.check.live import CheckFailed, Options, Result, check
from parallelkit.mesh import MeshSpec

__all__ = ["Options", "launch"]


def launch(trainer: Any, model: Any, datamodule: Any, options: Options) -> int:
    """Check that the run's layout splits its model, then run the check on every rank through the strategy's own
    launcher (`trainer`, `model` and `datamodule` as the run's config builds them; the model on the meta device)."""
    from parallelkit.compat import process_group_backend
    from parallelkit.strategies import ParallelkitStrategy

    strategy = trainer.strategy
    if isinstance(strategy, ParallelkitStrategy):
        strategy.check_run(model, datamodule, trainer.accumulate_grad_batches)
        spec = strategy.mesh_spec
    else:  # DDP and the like: every rank a replica
        spec = MeshSpec((trainer.world_size,), ("replicate",))
    launcher = strategy.launcher

    def on_each_rank() -> int:
        if hasattr(strategy, "set_world_ranks"):
            strategy.set_world_ranks()
        env = strategy.cluster_environment
        rank = env.global_rank() if env is not None else 0
        device = strategy.root_device
        if device.type == "cuda":
            import torch

            torch.cuda.set_device(device)
        address = (env.main_address, env.main_port) if env is not None else ("127.0.0.1", 29500)
        backend = process_group_backend(strategy)

        def stop_others() -> None:
            for proc in getattr(launcher, "procs", []):  # Lightning's launcher: rank 0 started the others
                proc.kill()

        try:
            result = check(spec, rank, device, backend, address, options)
        except CheckFailed as err:
            print(f"parallelkit check: {err}", file=sys.stderr, flush=True)
            return 1
        if result is None:
            return 0
        show(result, options)
        if not result.passed:
            stop_others()  # a rank that never joined or stopped answering would otherwise outlive the check
        return 0 if result.passed else 1

    return launcher.launch(on_each_rank) if launcher is not None else on_each_rank()


def show(result: Result, options: Options) -> None:
    if options.json:
        print(json.dumps(result.as_dict(), indent=2), flush=True)
        return
    console = Console(width=200)
    ranks = Table(title=f"parallelkit check: {len(result.reports)} ranks on mesh {result.mesh}")
    for column in ("rank", "host", "device", "memory", "torch", "cuda", "nccl", "driver", "launcher"):
        ranks.add_column(column, justify="right" if column in ("rank", "memory") else "left")
    for r in result.reports:
        memory = f"{r['device_memory'] / 2**30:.1f} GiB" if r["device_memory"] else "-"
        ranks.add_row(
            str(r["rank"]), r["host"], r["device"], memory, r["torch"], r["cuda"], r["nccl"], r["driver"], r["launcher"]
        )
    console.print(ranks)
    env = {k: v for r in result.reports[:1] for k, v in r["env"].items()}
    if env:
        console.print("environment (rank 0): " + ", ".join(f"{k}={v}" for k, v in env.items()))
    if result.measurements:
        table = Table(title="collectives per mesh axis (slowest group; nccl-tests' bus bandwidth)")
        for column in ("axis", "op", "size", "ranks/group", "latency", "algbw", "busbw", "slowest group"):
            table.add_column(column, justify="left" if column in ("axis", "op", "slowest group") else "right")
        for m in result.measurements:
            row: dict[str, Any] = m.as_dict()
            table.add_row(
                m.axis,
                m.op,
                size_text(m.size),
                str(m.group_size),
                f"{row['latency_us']:,.0f} us",
                f"{row['algbw_gbps']:.3g} GB/s",
                f"{row['busbw_gbps']:.3g} GB/s",
                ", ".join(map(str, row["slowest_group"])),
            )
        console.print(table)
    for warning in result.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    for failure in result.failures:
        console.print(f"[red]failed:[/] {escape(failure)}")
    console.print("[green]check passed[/]" if result.passed else "[red]check failed[/]")
