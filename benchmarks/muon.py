"""Muon against AdamW in the same layout: step time side by side, and what Muon's exchange sends per step.

    python benchmarks/muon.py                                   # GPT 4 x 256, [[2, 2], ["fsdp", "tp"]], 4 processes
    python benchmarks/muon.py --mesh '[[4], ["fsdp"]]'

One torchrun job; the two optimizers take turns (`--repeats` rounds of `--steps` steps each after `--warmup`), each
round on a fresh model from the same seed. Step time: wall time between the ends of consecutive steps (`StepClock`),
the ratio Muon / AdamW of the medians, with each round's. Bytes per optimizer step and rank by collective kind, from
`CommunicationMonitor`: FSDP's all-gathers and reduce-scatters for both, Muon's gathers (each matrix's update shards
to its owner, fp32) and scatters (the orthogonalised shards back, bf16) besides. Writes results/muon.json.
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
from comm import CommLog
from harness import StepClock, compare, forward, in_worker, launch, machine, quiet_trainer, write

from parallelkit import FSDPTPStrategy, Muon
from parallelkit.callbacks import CommunicationMonitor
from parallelkit.data import SyntheticDataModule
from parallelkit.models import GPT


class MuonGPT(GPT):
    """The GPT with `parallelkit.Muon` (learning rate matched to AdamW's per element) instead of its AdamW."""

    def configure_optimizers(self) -> Any:
        return Muon(self, lr=self.hparams.lr, adjust_lr_fn="match_rms_adamw")


def run(args: argparse.Namespace, optimizer: str) -> tuple[list[float], float, dict[str, float]]:
    L.seed_everything(0, verbose=False)
    clock, log = StepClock(), CommLog()
    strategy = FSDPTPStrategy(mesh_shape=json.loads(args.mesh))
    trainer = quiet_trainer(strategy, args.warmup + args.steps, [clock, CommunicationMonitor(), log])
    model = (MuonGPT if optimizer == "muon" else GPT)(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    samples = (args.warmup + args.steps + 1) * args.batch_size * dist.get_world_size()
    trainer.fit(model, SyntheticDataModule(seq_len=args.seq_len, batch_size=args.batch_size, num_samples=samples))
    times = clock.times[args.warmup :]
    cpu = statistics.median(clock.cpu_times[args.warmup :])
    steps = log.steps[args.warmup :]
    kinds = sorted({k for s in steps for k in s if k.endswith("_bytes")})
    return times, cpu, {k: statistics.median(s.get(k, 0.0) for s in steps) for k in kinds}


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    variants = ("adamw", "muon")
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    rounds, traffic = [], {}
    for _ in range(args.repeats):
        medians = {}
        for variant in variants:
            t, c, traffic[variant] = run(args, variant)
            times[variant] += t
            cpu[variant].append(c)
            medians[variant] = statistics.median(t)
        rounds.append(medians)
    tokens = args.batch_size * args.seq_len * dist.get_world_size()
    cpu_s = {v: statistics.median(c) for v, c in cpu.items()}
    result = compare(times, cpu_s, rounds, dict.fromkeys(variants), tokens, [("muon", "adamw")])
    result["bytes_per_step"] = traffic
    result["parameters"] = sum(
        p.numel() for p in GPT(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd).parameters()
    )
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", default='[[2, 2], ["fsdp", "tp"]]')
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--name", default="muon")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if in_worker():
        worker(args)
        return
    sizes = json.loads(args.mesh)[0]
    nproc = 1
    for size in sizes:
        nproc *= size
    out = Path(f"/tmp/parallelkit-bench-{args.name}.json")
    names = ("mesh", "steps", "warmup", "repeats", "batch_size", "n_layer", "n_head", "n_embd", "seq_len")
    launch(__file__, nproc, forward(args, names), out)
    result = json.loads(out.read_text())
    command = f"python benchmarks/muon.py --mesh '{args.mesh}'"
    write(args.name, {"machine": machine(), "command": command, "args": vars(args), **result})
    ratio = result["ratios"]["muon/adamw"]
    rounds = ", ".join(f"{r:.2f}" for r in ratio["per_round"])
    print(f"{args.mesh}: step time Muon / AdamW {ratio['median']:.2f}x (CPU {ratio['cpu']:.2f}x; rounds {rounds})")
    for variant, kinds in result["bytes_per_step"].items():
        print(f"  {variant:6s} " + "  ".join(f"{k.removeprefix('comm/')} {v / 2**20:.2f} MB" for k, v in kinds.items()))


if __name__ == "__main__":
    main()
