"""Shared helpers: multi-process runs go through a subprocess (the CLI or torchrun), never this process."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
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


def parallelkit(*args: str, cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "parallelkit.cli", *args], cwd, timeout, **env)


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


def fit(config: str, save_dir: Path, *overrides: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """`parallelkit fit --config configs/<config>` logging CSV under `save_dir`, quietly."""
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


SERIAL_FILES = ("test_plugins.py", "test_output.py", "test_diloco.py", "test_template.py")
"""Test files that uninstall and reinstall a plugin in this environment, or read the installed plugins or every
warning a run prints: under pytest-xdist they run one after another on one worker, so that no other test's process
meets a plugin half-installed."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadfile` (pyproject's addopts), with SERIAL_FILES as one file: each worker runs whole files, so a
    file's module fixtures are made once."""
    from xdist.scheduler import LoadFileScheduling

    class ByFile(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return "SERIAL_FILES" if Path(file).name in SERIAL_FILES else file

    return ByFile(config, log) if config.getvalue("dist") == "loadfile" else None


CORPUS_CHARS = 400_000


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small deterministic text corpus: the first 400 KB of the standard library sources the default data reads.

    Not this repository's own source (as it once was): then every edit to `src/` changed the data, and the tests
    whose bounds depend on it (reduced-precision gradients against fp32) passed or failed with unrelated changes."""
    from parallelkit.data.text import default_corpus_files

    def make(directory: Path) -> None:
        text, files = "", iter(default_corpus_files())
        while len(text) < CORPUS_CHARS:
            text += next(files).read_text()
        (directory / "corpus.txt").write_text(text[:CORPUS_CHARS])

    return made_once(tmp_path_factory, "corpus", make) / "corpus.txt"


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


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Callable[..., Reference]:
    """`reference(config, *overrides)`: a 20-step run of configs/<config> that checkpoints at step 10, made on first
    use and shared by every test of the session that compares with the same run."""

    def make(run: Path, config: str, overrides: tuple[str, ...]) -> None:
        checkpoint = checkpoint_every(run / "ckpt", 10)
        assert_ok(fit(config, run / "log", *common(corpus, run / "cache"), checkpoint, *overrides))

    def get(config: str, *overrides: str) -> Reference:
        key = hashlib.sha1(json.dumps([config, *overrides]).encode()).hexdigest()[:12]
        run = made_once(tmp_path_factory, f"reference-{key}", lambda run: make(run, config, overrides))
        return Reference(run / "log", run / "ckpt" / "epoch=0-step=10.ckpt")

    return get


@pytest.fixture(scope="session")
def baseline(reference: Callable[..., Reference]) -> Callable[[str], Reference]:
    """`baseline(name)`: the single-process run of a SINGLE_PROCESS variant."""
    return lambda name: reference("single.yaml", *SINGLE_PROCESS[name])


FSDP4 = [
    '--trainer.strategy.mesh_shape=[[4, 1], ["fsdp", "tp"]]',
    "--trainer.devices=4",
    "--data.init_args.batch_size=2",
]
"""hybrid.yaml on [[4, 1]]: 4 processes, each with 2 of the global batch of 8."""


@pytest.fixture(scope="session")
def fsdp4_fp32(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """hybrid.yaml on [[4, 1]] for 20 steps with the fp32 comm hook and profile_communication, each rank writing its
    training-state bytes at the end (`models.StateBytes`, under `<dir>/state`): its CSV log directory. One launch for
    test_comm.py's fp32 runs and test_fsdp_tp.py's sharded training-state measure, which each made it before (the
    monitor and the callback only observe: the losses stay one process's)."""

    def make(root: Path) -> None:
        assert_ok(
            fit(
                "hybrid.yaml",
                root,
                *common(corpus, root / "cache"),
                *FSDP4,
                "--trainer.strategy.comm_precision=fp32",
                "--trainer.strategy.profile_communication=true",
                callback("models.StateBytes", out_dir=str(root / "state")),
            )
        )

    return made_once(tmp_path_factory, "fsdp4_fp32", make)


@pytest.fixture(scope="session")
def ddp_fp32(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """configs/ddp.yaml (2 processes) under parallelkit's DDPStrategy (the `ddp_comm` preset's class) with the fp32
    hook (its default) and profile_communication, 20 steps: its CSV log directory. One launch for test_comm.py's DDP
    hook test and the uninterrupted run test_checkpoint.py's ddp_comm SIGTERM test compares with."""
    ddp = [
        "--trainer.strategy=parallelkit.DDPStrategy",
        "--trainer.strategy.comm_precision=fp32",
        "--trainer.strategy.profile_communication=true",
    ]

    def make(root: Path) -> None:
        assert_ok(fit("ddp.yaml", root, *common(corpus, root / "cache"), *ddp))

    return made_once(tmp_path_factory, "ddp_fp32", make)
