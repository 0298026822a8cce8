"""Pipeline schedules side by side: GPipe, 1F1B, interleaved 1F1B and the zero-bubble schedules (interleaved zero
bubble, ZB-V, DualPipeV) at several microbatch counts.

    python benchmarks/pipeline.py                     # pp=2 on 2 processes, m = 4 and 8
    python benchmarks/pipeline.py --microbatches 4 8 16 --n-layer 8
    python benchmarks/pipeline.py --schedules 1f1b zbv   # a subset

For each (schedule, m): median step time, the measured bubble (1 - busy / wall, summed over stages, from the
strategy's `schedule_stats`) next to the strategy's theory (`theoretical_bubble`: (p-1)/(v m + p-1) for GPipe and
the 1F1B family; for zero-bubble schedules the ideal with equal forward, input-gradient and weight-gradient times,
none for DualPipeV), and each rank's peak activation memory (bytes autograd holds for backward,
`ActivationMemoryMonitor`; under ZB-V and DualPipeV rank 0 holds the first and the last stage). Multi-stage schedules
run 2 stages per rank. Each rank processes one batch of m
microbatches of `--microbatch-size` sequences per step. Runs take turns (every configuration once per repeat).
Writes results/pipeline.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from harness import StepClock, chart, forward, in_worker, launch, machine, quiet_trainer, summarise, write

from parallelkit import PipelineStrategy
from parallelkit.callbacks import ActivationMemoryMonitor
from parallelkit.data import SyntheticDataModule
from parallelkit.models import GPT

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")


class BubbleLog(L.Callback):
    """The measured and theoretical bubble the strategy logs each step (rank 0 holds them; no theory for some
    schedules)."""

    def __init__(self) -> None:
        self.measured: list[float] = []
        self.theory: float | None = None

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        metrics = trainer.callback_metrics
        if "pp_bubble" in metrics:
            self.measured.append(float(metrics["pp_bubble"]))
        if "pp_bubble_theory" in metrics:
            self.theory = float(metrics["pp_bubble_theory"])


def run(args: argparse.Namespace, schedule: str, microbatches: int) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    clock, bubbles, activations = StepClock(), BubbleLog(), ActivationMemoryMonitor()
    batch = microbatches * args.microbatch_size
    strategy = PipelineStrategy(
        mesh_shape=[[dist.get_world_size()], ["pp"]], schedule=schedule, microbatches=microbatches, schedule_stats=True
    )
    trainer = quiet_trainer(strategy, args.warmup + args.steps, [clock, bubbles, activations])
    model = GPT(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    data = SyntheticDataModule(
        seq_len=args.seq_len, batch_size=batch, num_samples=(args.warmup + args.steps + 1) * batch
    )
    trainer.fit(model, data)
    device = trainer.strategy.root_device
    peaks = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor([activations.peak_bytes], dtype=torch.float64, device=device))
    return {
        "times": clock.times[args.warmup - 1 :],
        "bubble": bubbles.measured[args.warmup :],
        "bubble_theory": bubbles.theory,
        "stage_activation_mb": [p.item() / 2**20 for p in peaks],
    }


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    configs = [(s, m) for s in args.schedules for m in args.microbatches]
    runs: dict[str, dict[str, Any]] = {}
    for _ in range(args.repeats):
        for schedule, m in configs:
            key = f"{schedule} m={m}"
            result = run(args, schedule, m)
            entry = runs.setdefault(
                key, {"times": [], "bubble": [], "stage_activation_mb": result["stage_activation_mb"]}
            )
            entry["times"] += result["times"]
            entry["bubble"] += result["bubble"]
            entry["bubble_theory"] = result["bubble_theory"]
            entry["schedule"], entry["microbatches"] = schedule, m
    if dist.get_rank() == 0:
        out = {}
        for key, entry in runs.items():
            out[key] = {
                "schedule": entry["schedule"],
                "microbatches": entry["microbatches"],
                **summarise(entry["times"]),
                "bubble": statistics.median(entry["bubble"]),
                "bubble_theory": entry["bubble_theory"],
                "stage_activation_mb": entry["stage_activation_mb"],
            }
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="pipeline stages (processes)")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--microbatch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if in_worker():
        worker(args)
        return
    out = Path("/tmp/parallelkit-bench-pipeline.json")
    names = ("microbatch_size", "repeats", "steps", "warmup", "n_layer", "n_head", "n_embd", "seq_len")
    launch(__file__, args.nproc, forward(args, names, lists=("schedules", "microbatches")), out)
    runs = json.loads(out.read_text())
    result = {"machine": machine(), "command": "python benchmarks/pipeline.py", "args": vars(args), "runs": runs}
    write("pipeline", result)
    chart(
        "pipeline",
        f"pipeline pp={args.nproc}: bubble (measured vs theory) and rank-0 activations",
        {
            key: {
                "bubble %": 100 * r["bubble"],
                "theory %": float("nan") if r["bubble_theory"] is None else 100 * r["bubble_theory"],  # no bar
                "rank 0 act. MB": r["stage_activation_mb"][0],
            }
            for key, r in runs.items()
        },
        "% / MB",
    )
    for key, r in runs.items():
        theory = "-" if r["bubble_theory"] is None else f"{r['bubble_theory']:.3f}"
        print(
            f"{key:29s} step {r['median_s'] * 1000:7.1f} ms  bubble {r['bubble']:.3f} (theory {theory:>5s})"
            f"  activations MB per rank {[round(a, 2) for a in r['stage_activation_mb']]}"
        )


if __name__ == "__main__":
    main()
