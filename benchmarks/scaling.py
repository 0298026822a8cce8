"""Step time and per-rank memory as the model grows, per layout.

    python benchmarks/scaling.py                      # 4 GPT sizes x [[2,1]] and [[1,2]] on 2 processes
    python benchmarks/scaling.py --sizes 256x4 512x8 --layouts '[[4,1],["fsdp","tp"]]' --nproc 4

Sizes are `n_embd x n_layer` (head dim 32). Memory is `RankMonitor`'s `memory/peak_mb` (largest rank): CUDA's
max allocated bytes, or on CPU parameters + gradients + optimizer state + the peak of activations saved for
backward. RankMonitor runs in every configuration alike. Writes results/scaling.{json,png}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from harness import StepClock, chart, forward, in_worker, launch, machine, quiet_trainer, summarise, write

from parallelkit import FSDPTPStrategy, MeshSpec
from parallelkit.callbacks import RankMonitor
from parallelkit.data import SyntheticDataModule
from parallelkit.models import GPT


def run(args: argparse.Namespace, layout: str, n_embd: int, n_layer: int) -> dict[str, float]:
    L.seed_everything(0, verbose=False)
    spec = MeshSpec.parse(layout).resolve(1, dist.get_world_size())
    clock = StepClock()
    trainer = quiet_trainer(
        FSDPTPStrategy(mesh_shape=layout), args.warmup + args.steps, [clock, RankMonitor()], log_every_n_steps=1
    )
    model = GPT(n_layer=n_layer, n_head=n_embd // 32, n_embd=n_embd)
    params = sum(p.numel() for p in model.parameters())
    batch = args.global_batch // spec.dp_size
    samples = (args.warmup + args.steps + 1) * args.global_batch
    trainer.fit(model, SyntheticDataModule(seq_len=args.seq_len, batch_size=batch, num_samples=samples))
    return {
        "parameters": params,
        **summarise(clock.times[args.warmup - 1 :]),
        "peak_mb": float(trainer.callback_metrics["memory/peak_mb"]),
        "state_mb": float(trainer.callback_metrics["memory/state_mb"]),
    }


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    results = {}
    for size in args.sizes:
        n_embd, n_layer = map(int, size.split("x"))
        for layout in args.layouts:
            results[f"{size} {layout}"] = {"size": size, "layout": layout, **run(args, layout, n_embd, n_layer)}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--sizes", nargs="+", default=["128x2", "256x4", "384x6", "512x8"])
    parser.add_argument("--layouts", nargs="+", default=['[[2,1],["fsdp","tp"]]', '[[1,2],["fsdp","tp"]]'])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if in_worker():
        worker(args)
        return
    out = Path("/tmp/parallelkit-bench-scaling.json")
    names = ("steps", "warmup", "seq_len", "global_batch")
    launch(__file__, args.nproc, forward(args, names, lists=("sizes", "layouts")), out)
    runs = json.loads(out.read_text())
    write(
        "scaling", {"machine": machine(), "command": "python benchmarks/scaling.py", "args": vars(args), "runs": runs}
    )
    chart(
        "scaling",
        f"median step time by model size, {args.nproc} processes",
        {size: {layout: runs[f"{size} {layout}"]["median_s"] * 1000 for layout in args.layouts} for size in args.sizes},
        "ms per step",
    )
    for key, r in runs.items():
        print(
            f"{key:32s} {r['parameters'] / 1e6:6.2f}M params  step {r['median_s'] * 1000:8.1f} ms"
            f"  peak {r['peak_mb']:8.1f} MB"
        )


if __name__ == "__main__":
    main()
