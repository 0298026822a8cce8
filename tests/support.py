"""Test helpers shared by the test files (`from support import ...`): multi-process runs go through a subprocess (the
CLI or torchrun), never this process. Fixtures and pytest hooks are in conftest.py."""

from __future__ import annotations

import csv
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
SCRIPTS = TESTS / "scripts"


def free_port() -> int:
    """A port nothing listens on, for a launcher that must be told one (prefer letting the launcher pick: port 0).

    Chosen at random below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by
    default), which the kernel never hands out by itself: a port bound and released at 0 comes from that range and
    can be taken by any process's next outgoing connection (gloo opens many) before the launcher binds it again.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()  # not `random`: a test's seed_everything would give every session the same ports
    for _ in range(100):
        port = rng.randrange(10_000, max(low, 10_001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found below the ephemeral range")


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::DeprecationWarning", WANDB_MODE="offline")
    # Lightning's launcher would pick a port in the ephemeral range (see free_port), where another test's gloo
    # connections may take it first: tests run two at a time (pytest-xdist).
    env["MASTER_PORT"] = str(free_port())
    # tests/ on the path so configs can name test-only classes (tests/models.py) by class_path.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    if "PYTHONPATH" in extra:
        extra["PYTHONPATH"] = os.pathsep.join((extra["PYTHONPATH"], env["PYTHONPATH"]))
    env.update(extra)
    return env


def run(args: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run a command to completion, capturing output; the caller asserts on returncode and text."""
    return subprocess.run(args, cwd=cwd, env=subprocess_env(**env), capture_output=True, text=True, timeout=timeout)


def parallelkit(
    *args: str, cwd: Path, timeout: float = 600, fork: bool = False, **env: str
) -> subprocess.CompletedProcess:
    """`python -m parallelkit.cli ARGS` to completion. `fork`: for a command that starts no other process (a
    refusal before launch, `plan`, `export-hf`, ...), run in a fork of a process that imported the CLI once
    (tests/scripts/cli_server.py), which saves each command the interpreter's start and its imports."""
    if fork:
        return _forked(list(args), cwd, timeout, subprocess_env(**env))
    return run([sys.executable, "-m", "parallelkit.cli", *args], cwd, timeout, **env)


_SERVER: subprocess.Popen | None = None
_OUTPUT: Path | None = None  # where the forked command's stdout and stderr go, one command at a time


def _forked(args: list[str], cwd: Path, timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    import atexit

    global _SERVER, _OUTPUT
    if _SERVER is None or _SERVER.poll() is not None:
        server = [sys.executable, str(SCRIPTS / "cli_server.py")]
        _SERVER = subprocess.Popen(
            server, env=subprocess_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        atexit.register(_SERVER.kill)
    if _OUTPUT is None:
        _OUTPUT = Path(tempfile.mkdtemp(prefix="parallelkit-cli-"))
        atexit.register(shutil.rmtree, _OUTPUT, ignore_errors=True)
    out, err = _OUTPUT / "stdout", _OUTPUT / "stderr"
    request = {"args": args, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err), "timeout": timeout}
    _SERVER.stdin.write(json.dumps(request) + "\n")
    _SERVER.stdin.flush()
    returncode = json.loads(_SERVER.stdout.readline())["returncode"]
    stdout, stderr = out.read_text(), err.read_text()
    return subprocess.CompletedProcess(["parallelkit", *args], returncode, stdout, stderr)


def torchrun(script: str, nproc: int, *args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--standalone",  # c10d rendezvous on a port the launcher binds itself (localhost:0): none to collide with
        str(SCRIPTS / script),
        *args,
    ]
    return run(cmd, cwd, timeout)


def step_losses(save_dir: Path, key: str = "train_loss") -> dict[int, float]:
    """Per-step values of `key` from the CSVLogger files under `save_dir`."""
    files = sorted(save_dir.rglob("metrics.csv"))
    assert files, f"no metrics.csv under {save_dir}"
    with open(files[-1]) as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row.get(key)}


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )


def fit(
    config: str, save_dir: Path, *overrides: str, timeout: float = 600, fork: bool = False, **env: str
) -> subprocess.CompletedProcess:
    """`parallelkit fit --config configs/<config>` logging CSV under `save_dir`, quietly (`fork`: see parallelkit)."""
    save_dir.mkdir(parents=True, exist_ok=True)
    return parallelkit(
        "fit",
        "--config",
        str(REPO / "configs" / config),
        f"--trainer.logger.init_args.save_dir={save_dir}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        *overrides,
        cwd=save_dir,
        timeout=timeout,
        fork=fork,
        **env,
    )


def common(corpus: Path, cache: Path, steps: int = 20) -> list[str]:
    """CLI overrides every parity run shares: a step budget, no validation, the test corpus and its cache."""
    return [
        f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=0",
        f"--data.init_args.paths={corpus}",
        f"--data.init_args.cache_dir={cache}",
    ]


def checkpoint_every(dirpath: Path, steps: int, last: bool = False) -> str:
    """A ModelCheckpoint callback, as a CLI override, saving every `steps` steps (all of them kept)."""
    return (
        '--trainer.callbacks+={"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": '
        f'{{"dirpath": "{dirpath}", "every_n_train_steps": {steps}, "save_top_k": -1, '
        f'"save_last": {str(last).lower()}}}}}'
    )


def callback(class_path: str, **init_args: object) -> str:
    """A callback added to the configured ones, as a CLI override: `callback("models.StopAfter", step=10)`."""
    return "--trainer.callbacks+=" + json.dumps({"class_path": class_path, "init_args": init_args})


def assert_same_losses(expected: dict[int, float], actual: dict[int, float], rtol: float = 1e-5) -> None:
    assert sorted(expected) == sorted(actual), (sorted(expected), sorted(actual))
    for step, value in expected.items():
        assert abs(actual[step] - value) <= rtol * abs(value), f"step {step}: {value} vs {actual[step]}"


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> Path:
    """The directory `name`, filled by `make(directory)` in the first of the session's pytest processes that asks for
    it: pytest-xdist's workers share one temporary root, and a run one worker made (a baseline, a shared launch) is
    read by the others instead of being made again. A `make` that fails leaves nothing for the next to read."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    directory, done = root / "shared" / name, root / "shared" / f"{name}.done"
    directory.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{directory}.lock"):
        if not done.exists():
            if directory.exists():
                shutil.rmtree(directory)
            directory.mkdir()
            make(directory)
            done.touch()
    return directory


CORPUS_CHARS = 400_000


SINGLE_PROCESS = {
    "plain": (),
    "accumulate": ("--trainer.accumulate_grad_batches=2",),
    "clip": ("--trainer.gradient_clip_val=0.05",),
    "val": ("--trainer.val_check_interval=10", "--trainer.limit_val_batches=3"),
}
"""The single-process baselines parity tests compare with, by name: overrides of configs/single.yaml."""


@dataclass(frozen=True)
class Reference:
    """A finished 20-step run that checkpointed at step 10."""

    log: Path
    checkpoint: Path

    def losses(self, key: str = "train_loss") -> dict[int, float]:
        return step_losses(self.log, key)


FSDP4 = [
    '--trainer.strategy.mesh_shape=[[4, 1], ["fsdp", "tp"]]',
    "--trainer.devices=4",
    "--data.init_args.batch_size=2",
]
"""hybrid.yaml on [[4, 1]]: 4 processes, each with 2 of the global batch of 8."""
