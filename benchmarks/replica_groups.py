"""What losing a replica group costs the others: the survivor's steps around a SIGKILL, and a restart's way back;
and (`--compare`) what replica groups cost against HSDP on the same processes, with and without the overlap.

    python benchmarks/replica_groups.py                          # 2 groups x 1 process, kill at 100, 3 s down
    python benchmarks/replica_groups.py --processes 2 --heartbeat-ms 500 --steps 3000
    python benchmarks/replica_groups.py --compare --processes 2 --steps 60

`--compare` runs, one after the other on the same machine, the same model and global batch three ways on 2 x
`--processes` processes: HSDP without torchft (`[[2, n], ["replicate", "fsdp"]]`, one launch), and 2 replica groups
of `[[n], ["fsdp"]]` with the cross-group all-reduce flat after backward (`overlap=false`) and per FSDP unit during
backward (`overlap=true`); each one's median step (after `--warmup`) and the groups' as ratios of HSDP's. The model
is hybrid.yaml's GPT at `--layers` x `--width`. Writes results/replica_groups_overlap.json.

`parallelkit lighthouse` and two replica groups, each `parallelkit fit --config configs/hybrid.yaml` as a user
launches it (`[[n], ["fsdp"]]` inside each group, fp32, its own session). When group 1 reaches step `--kill-at`, its
whole launch is SIGKILLed; `--down` seconds later it is launched again and comes back, copying group 0's state. Each
group's rank 0 writes the wall-clock time at the end of every step (`StepClock`), and its CSV log the groups each step
had. Reported: group 0's median step (after `--warmup`), its longest step from the kill until it goes on alone and
around the step group 1 comes back in (each as a multiple of the median: the heartbeat timeout bounds the first), the
steps it committed alone, and group 1's time from its relaunch to its join (the copy of group 0's state) and to its
first committed step. Writes results/replica_groups.json (`--name` sets the name).

On a machine with fewer cores than processes, the groups share cores: the step times are then those of shared cores,
and the relaunch's start-up (an interpreter, imports, the model) slows the survivor while it runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
from harness import free_port, machine, write

REPO = Path(__file__).resolve().parents[1]


class StepClock(L.Callback):
    """Rank 0 appends `{"step": committed steps, "t": wall-clock seconds}` to `path` at the end of every step."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "t": time.time()}) + "\n")


def start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """`command` in a session of its own (so that a SIGKILL reaches every process it starts), its output to `log`."""
    out = (log.parent / f"{log.name}.out").open("w")
    return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def fit_command(args: argparse.Namespace, log: Path, mesh: str, devices: int, *extra: str) -> list[str]:
    """hybrid.yaml on `mesh` over `devices` processes for `--steps` steps, rank 0's step ends written to log."""
    clock = {"class_path": "replica_groups.StepClock", "init_args": {"path": str(log / "clock.jsonl")}}
    return [
        sys.executable,
        "-m",
        "parallelkit.cli",
        "fit",
        "--config",
        str(REPO / "configs" / "hybrid.yaml"),
        f"--trainer.strategy.mesh_shape={mesh}",
        f"--trainer.devices={devices}",
        f"--trainer.max_steps={args.steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={log}",
        f"--trainer.callbacks+={json.dumps(clock)}",
        *extra,
    ]


def group_command(group: int, address: str, args: argparse.Namespace, log: Path, *extra: str) -> list[str]:
    return fit_command(
        args,
        log,
        f'[[{args.processes}], ["fsdp"]]',
        args.processes,
        f"--trainer.strategy.replica_groups.group={group}",
        "--trainer.strategy.replica_groups.num_groups=2",
        f"--trainer.strategy.replica_groups.lighthouse={address}",
        "--trainer.strategy.replica_groups.hostname=127.0.0.1",
        *extra,
    )


def clock(log: Path) -> list[dict[str, float]]:
    path = log / "clock.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def groups_per_step(log: Path) -> dict[int, int]:
    (metrics,) = log.glob("**/metrics.csv")
    return {
        int(row["step"]): int(float(row["ft/groups"])) for row in csv.DictReader(metrics.open()) if row.get("ft/groups")
    }


def median_step(log: Path, warmup: int) -> float:
    ends = [entry["t"] for entry in clock(log)]
    return statistics.median([b - a for a, b in zip(ends, ends[1:])][warmup:])


def compare(args: argparse.Namespace, env: dict[str, str]) -> None:
    """HSDP, then 2 groups flat, then 2 groups overlapped, on the same processes (module docstring)."""
    model = [f"--model.init_args.n_layer={args.layers}", f"--model.init_args.n_embd={args.width}"]
    batch = ["--data.init_args.batch_size=2"]  # a global batch of 2 x 2 x n rows, every way
    medians = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hsdp = fit_command(args, root / "hsdp", f'[[2, {args.processes}], ["replicate", "fsdp"]]', 2 * args.processes)
        if start([*hsdp, *model, *batch], root / "hsdp", env).wait() != 0:
            sys.exit(f"HSDP failed: {(root / 'hsdp.out').read_text()[-3000:]}")
        medians["hsdp"] = median_step(root / "hsdp", args.warmup)
        for overlap in (False, True):
            name = "groups_overlapped" if overlap else "groups_flat"
            port = free_port()
            lighthouse = [
                sys.executable,
                "-m",
                "parallelkit.cli",
                "lighthouse",
                "--port",
                str(port),
                "--min-groups",
                "2",
            ]
            lighthouse_job = start(lighthouse, root / f"{name}-lh", env)
            try:
                time.sleep(2)
                option = f"--trainer.strategy.replica_groups.overlap={str(overlap).lower()}"
                logs = [root / f"{name}{g}" for g in (0, 1)]
                address = f"http://127.0.0.1:{port}"
                jobs = [
                    start([*group_command(g, address, args, logs[g], option), *model, *batch], logs[g], env)
                    for g in (0, 1)
                ]
                if any(job.wait(timeout=3600) != 0 for job in jobs):
                    sys.exit(f"{name} failed: {(root / f'{name}0.out').read_text()[-3000:]}")
            finally:
                os.killpg(lighthouse_job.pid, signal.SIGTERM)
                lighthouse_job.wait()
            medians[name] = median_step(logs[0], args.warmup)
    result = {
        "machine": machine(),
        "processes": 2 * args.processes,
        "model": f"GPT {args.layers} layers x {args.width}",
        "steps": args.steps,
        "median_step_s": medians,
        "groups_flat_vs_hsdp": medians["groups_flat"] / medians["hsdp"],
        "groups_overlapped_vs_hsdp": medians["groups_overlapped"] / medians["hsdp"],
        "overlapped_vs_flat": medians["groups_overlapped"] / medians["groups_flat"],
    }
    print(f"wrote {write(args.name, result)}")
    print(json.dumps(result, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=1, help="processes per group (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--kill-at", type=int, default=100, help="group 1's step to be killed at")
    parser.add_argument("--down", type=float, default=3.0, help="seconds before group 1 is launched again")
    parser.add_argument("--heartbeat-ms", type=int, default=1000, help="the lighthouse's heartbeat timeout")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--name", default=None, help="default: replica_groups, or replica_groups_overlap")
    parser.add_argument("--compare", action="store_true", help="HSDP against groups flat and overlapped")
    parser.add_argument("--layers", type=int, default=4, help="--compare's model depth (default: %(default)s)")
    parser.add_argument("--width", type=int, default=256, help="--compare's model width (default: %(default)s)")
    args = parser.parse_args()
    args.name = args.name or ("replica_groups_overlap" if args.compare else "replica_groups")
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])),
    )
    if args.compare:
        compare(args, env)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        port = free_port()
        lighthouse = ["--port", str(port), "--min-groups", "1", "--heartbeat-timeout-ms", str(args.heartbeat_ms)]
        lighthouse_job = start([sys.executable, "-m", "parallelkit.cli", "lighthouse", *lighthouse], root / "lh", env)
        address = f"http://127.0.0.1:{port}"
        logs = {"survivor": root / "group0", "killed": root / "group1", "returned": root / "group1-back"}
        try:
            time.sleep(2)  # the lighthouse serving
            jobs = [
                start(group_command(g, address, args, logs[k]), logs[k], env)
                for g, k in ((0, "survivor"), (1, "killed"))
            ]
            while not any(entry["step"] >= args.kill_at for entry in clock(logs["killed"])):
                if any(job.poll() not in (None, 0) for job in jobs):
                    sys.exit(f"a group failed before the kill: see {root}")
                time.sleep(0.01)
            os.killpg(jobs[1].pid, signal.SIGKILL)
            killed_at = time.time()
            jobs[1].wait()
            time.sleep(args.down)
            relaunched_at = time.time()
            jobs.append(start(group_command(1, address, args, logs["returned"]), logs["returned"], env))
            for job in (jobs[0], jobs[2]):
                if job.wait(timeout=1800) != 0:
                    sys.exit(f"a group failed: {(root / 'group0.out').read_text()[-3000:]}")
            survivor, returned = clock(logs["survivor"]), clock(logs["returned"])
            groups = groups_per_step(logs["survivor"])
        finally:
            os.killpg(lighthouse_job.pid, signal.SIGTERM)
            lighthouse_job.wait()
    ends = [entry["t"] for entry in survivor]
    steps = [b - a for a, b in zip(ends, ends[1:])]  # steps[i]: the survivor's step i + 1
    median = statistics.median(steps[args.warmup :])
    killed_step = next(i for i, t in enumerate(ends) if t > killed_at)  # the first step to end after the kill
    alone = sorted(step for step, mask in groups.items() if mask == 1)
    back = min((step for step in groups if step > alone[-1]), default=None) if alone else None
    if back is None:
        sys.exit(f"group 1 did not come back before group 0 ended ({len(steps)} steps): give more --steps")
    around_kill = max(steps[killed_step - 1 : killed_step + 2])
    around_return = max(steps[back - 2 : back + 1]) if back else None
    result = {
        "machine": machine(),
        "processes_per_group": args.processes,
        "heartbeat_timeout_ms": args.heartbeat_ms,
        "down_s": args.down,
        "survivor_median_step_s": median,
        "survivor_longest_step_after_kill_s": around_kill,
        "after_kill_vs_median": around_kill / median,
        "survivor_longest_step_at_return_s": around_return,
        "at_return_vs_median": around_return / median if around_return else None,
        "steps_alone": len(alone),
        "returned_at_step": back,
        "relaunch_to_first_commit_s": returned[0]["t"] - relaunched_at if returned else None,
        "kill_to_first_commit_alone_s": ends[killed_step] - killed_at,
    }
    print(f"wrote {write(args.name, result)}")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
