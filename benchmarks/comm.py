"""Gradient communication per optimizer step under each comm hook, and what gradient accumulation does to it.

    python benchmarks/comm.py                         # fsdp [[2,1]] on 2 processes, hooks fp32 bf16 fp16 int8
    python benchmarks/comm.py --nproc 4 --accumulate 1 4

Bytes and host time per optimizer step by collective kind, from `CommunicationMonitor`, with the median step
time. Bytes are exact (they do not depend on the machine); times on CPU/gloo are dominated by latency.
Writes results/comm.{json,png}.
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

from parallelkit import FSDPTPStrategy
from parallelkit.callbacks import CommunicationMonitor
from parallelkit.data import SyntheticDataModule
from parallelkit.models import GPT

HOOKS = ("fp32", "bf16", "fp16", "int8")


class CommLog(L.Callback):
    """What CommunicationMonitor logged for each optimizer step (placed after it, so the step's own figures)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._last_step = -1

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step != self._last_step:
            self._last_step = trainer.global_step
            self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("comm/")})


def run(args: argparse.Namespace, hook: str, accumulate: int) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    clock, log = StepClock(), CommLog()
    world = dist.get_world_size()
    strategy = FSDPTPStrategy(mesh_shape=[[world], ["fsdp"]], comm_precision=hook)
    callbacks = [clock, CommunicationMonitor(), log]
    trainer = quiet_trainer(strategy, args.warmup + args.steps, callbacks, accumulate_grad_batches=accumulate)
    model = GPT(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    samples = (args.warmup + args.steps + 1) * accumulate * args.batch_size * world
    trainer.fit(model, SyntheticDataModule(seq_len=args.seq_len, batch_size=args.batch_size, num_samples=samples))
    steps = log.steps[args.warmup :]
    kinds = sorted({k for s in steps for k in s})
    return {
        "parameters": sum(
            p.numel() for p in GPT(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd).parameters()
        ),
        "per_step": {k: statistics.median(s.get(k, 0.0) for s in steps) for k in kinds},
        "times": [
            sum(clock.times[i * accumulate : (i + 1) * accumulate])
            for i in range(args.warmup, args.warmup + args.steps - 1)
        ],
    }


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    results: dict[str, Any] = {}
    for accumulate in args.accumulate:
        for hook in args.hooks:
            r = run(args, hook, accumulate)
            results[f"{hook} acc={accumulate}"] = {
                "hook": hook,
                "accumulate": accumulate,
                "parameters": r["parameters"],
                **r["per_step"],
                **summarise(r["times"]),
            }
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hooks", nargs="+", default=list(HOOKS))
    parser.add_argument("--accumulate", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if in_worker():
        worker(args)
        return
    out = Path("/tmp/parallelkit-bench-comm.json")
    names = ("steps", "warmup", "batch_size", "n_layer", "n_head", "n_embd", "seq_len")
    launch(__file__, args.nproc, forward(args, names, lists=("hooks", "accumulate")), out)
    runs = json.loads(out.read_text())
    write("comm", {"machine": machine(), "command": "python benchmarks/comm.py", "args": vars(args), "runs": runs})
    gradient_bytes = ("comm/reduce_scatter_bytes", "comm/all_to_all_bytes")
    chart(
        "comm",
        f"gradient bytes per optimizer step, fsdp={args.nproc}",
        {key: {"MB": sum(r.get(k, 0) for k in gradient_bytes) / 2**20} for key, r in runs.items()},
        "MB per optimizer step",
    )
    for key, r in runs.items():
        sent = sum(r.get(k, 0) for k in gradient_bytes)
        print(
            f"{key:14s} gradient bytes/step {sent:12,.0f} ({sent / (4 * r['parameters']):.3f} x fp32 params)"
            f"  step {r['median_s'] * 1000:.1f} ms"
        )


if __name__ == "__main__":
    main()
