"""What every benchmark shares: launching itself under torchrun, timing steps, summarising, writing results.

A benchmark script is run as `python benchmarks/<name>.py [options]`; with no torchrun environment it launches
itself under torchrun (one job per layout) and, when the workers are done, gathers their JSON into
`benchmarks/results/<name>.json` and a chart `benchmarks/results/<name>.png`.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch

RESULTS = Path(__file__).resolve().parent / "results"


def in_worker() -> bool:
    return "LOCAL_RANK" in os.environ


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str, nproc: int, args: Sequence[str], out: Path) -> None:
    """Run `script` under torchrun on `nproc` local processes; its rank 0 writes `out`."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        script,
        *args,
        f"--out={out}",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"benchmark worker failed ({' '.join(cmd)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def accelerator() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def summed_over_ranks(values: Sequence[float]) -> list[float]:
    """Each value summed over every process of the job (on the accelerator: nccl reduces device tensors only)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=accelerator())
    dist.all_reduce(t)
    return t.tolist()


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    info = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "threads_per_process": int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def quiet_trainer(strategy: Any, steps: int, callbacks: list[L.Callback], **kwargs: Any) -> L.Trainer:
    """A Trainer on every local process of the job, with nothing but training and the given callbacks."""
    import torch.distributed as dist

    return L.Trainer(
        accelerator=accelerator(),
        devices=dist.get_world_size(),
        strategy=strategy,
        max_steps=steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )


def forward(args: Any, names: Sequence[str], lists: Sequence[str] = ()) -> list[str]:
    """The launcher's options, as the command-line flags its workers parse again (`lists`: nargs="+" options)."""
    flags: list[str] = []
    for name in lists:
        flags += [f"--{name.replace('_', '-')}", *map(str, getattr(args, name))]
    return flags + [f"--{n.replace('_', '-')}={getattr(args, n)}" for n in names]


class StepClock(L.Callback):
    """Wall time between the ends of consecutive optimizer steps: the step period a user sees, loop included; and
    the CPU time this process spent in that period (`cpu_times`), which other jobs on the machine disturb less."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.first_step_s: float | None = None  # from `start()` to the first step's end: compilation shows here
        self._start: float | None = None
        self._last: tuple[float, float] | None = None

    def start(self) -> None:
        """Mark the start of training."""
        synchronize()
        self._start = time.perf_counter()

    def tick(self) -> None:
        """Mark the end of a step."""
        synchronize()
        now = (time.perf_counter(), time.process_time())
        if self._last is not None:
            self.times.append(now[0] - self._last[0])
            self.cpu_times.append(now[1] - self._last[1])
        elif self._start is not None:
            self.first_step_s = now[0] - self._start
        self._last = now

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.start()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.tick()


def summarise(times: Sequence[float]) -> dict[str, float]:
    """Median and interquartile range of step times (seconds)."""
    q1, median, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    return {"median_s": median, "q1_s": q1, "q3_s": q3, "iqr_s": q3 - q1, "steps": len(times)}


def compare(
    times: dict[str, list[float]],
    cpu_s: dict[str, float],
    rounds: list[dict[str, float]],
    memory: dict[str, float | None],
    tokens: int,
    pairs: Sequence[tuple[str, str]],
) -> dict[str, Any]:
    """Each variant's step times summarised, with tokens/s, CPU time per step (`cpu_s`) and peak memory, and for each
    pair (a, b) of `pairs` the ratios a / b of the median step times, of the CPU times and of each round's medians
    (`rounds`: per turn of all variants, each one's median step time)."""
    result: dict[str, Any] = {
        v: {**summarise(t), "tokens_per_s": tokens / statistics.median(t), "cpu_s": cpu_s[v], "peak_mb": memory[v]}
        for v, t in times.items()
    }
    result["ratios"] = {
        f"{a}/{b}": {
            "median": result[a]["median_s"] / result[b]["median_s"],
            "cpu": result[a]["cpu_s"] / result[b]["cpu_s"],
            "per_round": [r[a] / r[b] for r in rounds],
        }
        for a, b in pairs
    }
    return result


def peak_memory_mb() -> float | None:
    """Peak allocated accelerator memory since the last reset (None on CPU, where no allocator records one)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated() / 2**20


def reset_peak_memory() -> None:
    """Start a variant's peak from what is live now: the last variant's model and optimizer collected first (its
    Trainer holds reference cycles), else they would count in this one's peak."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def write(name: str, result: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def chart(name: str, title: str, groups: dict[str, dict[str, float]], ylabel: str) -> Path:
    """A grouped bar chart: one group per key of `groups`, one bar per inner key."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(groups)
    series = list(dict.fromkeys(k for g in groups.values() for k in g))
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(labels)), 3.6))
    for i, key in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, [groups[label].get(key, 0) for label in labels], width, label=key)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
