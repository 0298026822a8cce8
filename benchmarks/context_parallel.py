"""Context parallelism side by side: tokens/s and activations per process at cp = 1, 2, 4 on the same sequences.

    python benchmarks/context_parallel.py                              # 4096 tokens, cp 1 2 4, Ulysses, 3 turns
    python benchmarks/context_parallel.py --seq-lens 2048 4096 8192 --budget-mb 50 --method allgather

Each layout is `parallelkit fit --config configs/long_context.yaml` as a user runs it (the GPT at 2 x 128, one
sequence a step, fp32): cp processes on `[[cp], ["cp"]]`, and cp = 1 one process on `[[1], ["fsdp"]]`. The layouts
take turns (cp 1, 2, 4, then again, `--repeats` times), so drift in the machine's speed hits all alike. From each
run's CSV log: the slowest rank's step time (RankMonitor's `rank/step_s_max`) after `--warmup` steps, tokens/s =
seq_len / that, RankMonitor's activations held for backward (the largest rank's), and the losses, which must be the
same in every layout (the benchmark stops otherwise). Reported per layout: the median over turns, ratios to cp = 1,
and with `--budget-mb`, the longest measured sequence whose activations per process fit it. Writes
results/context_parallel.json (`--name` sets the name).

On a machine with fewer cores than processes, the processes share cores (each runs one thread: OMP_NUM_THREADS=1):
the speed ratios then say what sharing costs, not what cp does on separate devices; the activation ratios hold.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import machine, write

REPO = Path(__file__).resolve().parents[1]


def run(seq_len: int, cp: int, method: str, steps: int, log: Path) -> dict[str, list[float]]:
    """One `parallelkit fit` of configs/long_context.yaml; its per-step values from rank 0's CSV log."""
    mesh = f'[[{cp}], ["cp"]]' if cp > 1 else '[[1], ["fsdp"]]'
    command = [
        sys.executable,
        "-m",
        "parallelkit.cli",
        "fit",
        "--config",
        str(REPO / "configs" / "long_context.yaml"),
        f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=0",
        f"--trainer.strategy.mesh_shape={mesh}",
        f"--trainer.strategy.cp_method={method}",
        f"--trainer.devices={cp}",
        f"--data.init_args.seq_len={seq_len}",
        f"--trainer.logger.init_args.save_dir={log}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(command, env=env, capture_output=True, text=True, cwd=log.parent)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    (metrics,) = log.glob("**/metrics.csv")
    values: dict[str, list[float]] = {"step_s": [], "activations_mb": [], "loss": []}
    for row in csv.DictReader(metrics.open()):
        for key, column in (("step_s", "rank/step_s_max"), ("activations_mb", "memory/activations_mb")):
            if row.get(column):
                values[key].append(float(row[column]))
        if row.get("train_loss"):
            values["loss"].append(float(row["train_loss"]))
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--method", default="ulysses", choices=("ulysses", "allgather"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-mb", type=float, default=None)
    parser.add_argument("--name", default="context_parallel")
    args = parser.parse_args()
    medians: dict[tuple[int, int], list[float]] = {}
    activations: dict[tuple[int, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(args.repeats):
            for seq_len in args.seq_lens:
                losses = None
                for cp in args.cps:
                    values = run(seq_len, cp, args.method, args.steps, Path(tmp) / f"t{turn}_{seq_len}_{cp}")
                    if losses is not None and any(abs(a - b) > 1e-4 * abs(b) for a, b in zip(values["loss"], losses)):
                        sys.exit(f"seq_len={seq_len}: cp={cp}'s losses {values['loss']} are not cp={args.cps[0]}'s")
                    losses = values["loss"]
                    step = statistics.median(values["step_s"][args.warmup :])
                    medians.setdefault((seq_len, cp), []).append(step)
                    activations[(seq_len, cp)] = max(values["activations_mb"])
                    print(f"turn {turn}: seq_len {seq_len} cp {cp}: {step:.3f} s/step", flush=True)
    layouts = {}
    for (seq_len, cp), steps in medians.items():
        step = statistics.median(steps)
        one = statistics.median(medians[(seq_len, args.cps[0])])
        layouts[f"{seq_len}_cp{cp}"] = {
            "seq_len": seq_len,
            "cp": cp,
            "step_s": step,
            "step_s_per_turn": steps,
            "tokens_per_s": seq_len / step,
            "tokens_per_s_per_process": seq_len / step / cp,
            "speed_vs_cp1": one / step,
            "activations_mb": activations[(seq_len, cp)],
            "activations_vs_cp1": activations[(seq_len, cp)] / activations[(seq_len, args.cps[0])],
        }
    result = {"machine": machine(), "method": args.method, "steps": args.steps, "warmup": args.warmup}
    result["layouts"] = layouts
    if args.budget_mb is not None:
        result["budget_mb"] = args.budget_mb
        result["longest_within_budget"] = {
            cp: max((s for s in args.seq_lens if activations[(s, cp)] <= args.budget_mb), default=None)
            for cp in args.cps
        }
    print(f"wrote {write(args.name, result)}")
    print("| seq_len | cp | step (s) | tokens/s | vs cp 1 | activations per process (MB) | vs cp 1 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in layouts.values():
        print(
            f"| {row['seq_len']} | {row['cp']} | {row['step_s']:.3f} | {row['tokens_per_s']:.0f} | "
            f"{row['speed_vs_cp1']:.2f}x | {row['activations_mb']:.1f} | {row['activations_vs_cp1']:.2f}x |"
        )
    if args.budget_mb is not None:
        print(f"longest measured sequence within {args.budget_mb} MB of activations: {result['longest_within_budget']}")


if __name__ == "__main__":
    main()
