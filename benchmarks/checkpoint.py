"""Training with checkpoints every N steps: synchronous saves, `async_checkpoint` (written in the background), none.

    python benchmarks/checkpoint.py                          # a 322M-parameter Llama, fsdp [[4, 1]], 4 processes
    python benchmarks/checkpoint.py --hidden 768 --layers 8 --steps 25 --every 10 --rounds 2

One job of `--nproc` processes (torchrun), `FSDPTPStrategy` on `[[nproc, 1]]`, `HFCausalLM` (a Llama of the given
size, fp32, AdamW) on synthetic tokens. Per run of `--steps` steps: no checkpoint callback (`none`), or
ModelCheckpoint saving a sharded checkpoint every `--every` steps (keeping all), synchronous (`sync`) or with
`async_checkpoint: true` (`async`). The variants take turns (none, sync, async, then async, sync, none, ...) so drift
in the machine's speed hits all alike. Per variant: the mean step time over the run's steps (the first dropped: its
time is start-up), which is what a save's stall shows in; the slowest step; how long a save held rank 0's training
up (the whole write when synchronous, the copy in memory when asynchronous); and the whole fit's wall time, whose end
waits for the last background write. Ratios to `none`. Writes results/checkpoint.json.

Needs the extras: pip install -e ".[hf]".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import StepClock, accelerator, forward, in_worker, launch, machine, write  # noqa: E402

from parallelkit import FSDPTPStrategy  # noqa: E402
from parallelkit.data import SyntheticDataModule  # noqa: E402
from parallelkit.models import HFCausalLM  # noqa: E402

VARIANTS = ("none", "sync", "async")


def llama(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 11 // 4,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": args.hidden // 64,
        "tie_word_embeddings": False,
    }


def run(variant: str, args: argparse.Namespace, directory: str) -> dict[str, Any]:
    import lightning as L

    L.seed_everything(0, verbose=False)
    strategy = FSDPTPStrategy(mesh_shape=[[args.nproc, 1], ["fsdp", "tp"]], async_checkpoint=variant == "async")
    clock = StepClock()
    callbacks: list[Any] = [clock]
    if variant != "none":
        callbacks.append(ModelCheckpoint(dirpath=directory, every_n_train_steps=args.every, save_top_k=-1))
    trainer = L.Trainer(
        accelerator=accelerator(),
        devices=args.nproc,
        strategy=strategy,
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=variant != "none",
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    data = SyntheticDataModule(vocab_size=32000, seq_len=args.seq_len, batch_size=args.batch_size)
    model = HFCausalLM(config=llama(args))
    stalls: list[float] = []  # how long each save held this rank's training up
    save = strategy.save_checkpoint

    def timed_save(*a: Any, **k: Any) -> None:
        start = time.perf_counter()
        save(*a, **k)
        stalls.append(time.perf_counter() - start)

    strategy.save_checkpoint = timed_save
    started = time.perf_counter()
    trainer.fit(model, data)
    wall = time.perf_counter() - started
    params = sum(p.numel() for p in model.parameters())
    return {"times": clock.times, "wall_s": wall, "params": params, "stalls": stalls}


def worker(args: argparse.Namespace) -> None:
    order = [v for r in range(args.rounds) for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1])]
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for i, variant in enumerate(order):
        results[variant].append(run(variant, args, os.path.join(args.dir, f"{i}_{variant}")))
    if dist.get_rank() != 0:
        return
    summary: dict[str, Any] = {"machine": machine(), "options": {k: v for k, v in vars(args).items() if k != "out"}}
    for variant, runs in results.items():
        times = [t for r in runs for t in r["times"]]
        summary[variant] = {
            "mean_step_s": statistics.fmean(times),
            "median_step_s": statistics.median(times),
            "slowest_step_s": max(times),
            "wall_s": statistics.fmean(r["wall_s"] for r in runs),
            "save_stall_s": statistics.fmean(s for r in runs for s in r["stalls"]) if variant != "none" else 0.0,
            "params": runs[0]["params"],
        }
    for variant in ("sync", "async"):
        summary[f"{variant}/none"] = {
            key: summary[variant][key] / summary["none"][key] for key in ("mean_step_s", "wall_s")
        }
    Path(args.out).write_text(json.dumps(summary, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1, help="samples per process per step")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--every", type=int, default=10, help="a checkpoint every this many steps")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dir", help="where the checkpoints are written (default: a temporary directory)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if in_worker():
        args.nproc = int(os.environ["WORLD_SIZE"])
        worker(args)
        return
    names = ["hidden", "layers", "seq_len", "batch_size", "steps", "every", "rounds"]
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        out = Path(directory) / "result.json"
        launch(__file__, args.nproc, [*forward(args, names), f"--dir={directory}"], out)
        result = json.loads(out.read_text())
    path = write("checkpoint", result)
    params = result["none"]["params"]
    print(f"{params / 1e6:.0f}M parameters, [[{args.nproc}, 1]], a checkpoint every {args.every} of {args.steps} steps")
    for variant in VARIANTS:
        r = result[variant]
        ratio = f"  {result[f'{variant}/none']['mean_step_s']:.3f}x none" if variant != "none" else ""
        print(
            f"{variant:>6}: mean step {r['mean_step_s']:.3f} s (median {r['median_step_s']:.3f}, slowest "
            f"{r['slowest_step_s']:.2f}), a save stalls rank 0 {r['save_stall_s']:.2f} s, "
            f"fit {r['wall_s']:.1f} s{ratio}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
