"""Test helpers shared by the test files (`from support import ...`): multi-process runs are jobs whose ranks are
forked from a server process that imported the CLI once (`launch`; tests/README.md), or real launches where the
launcher is under test; never this process. Fixtures and pytest hooks are in conftest.py."""

from __future__ import annotations

import atexit
import contextlib
import csv
import importlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
SCRIPTS = TESTS / "scripts"


def import_dotted(dotted: str) -> object:
    """What a dotted name names, as mkdocstrings finds it: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            found = getattr(found, part)
        return found
    raise ImportError(dotted)


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


def slack(seconds: float) -> float:
    """`seconds` stretched by how busy this machine is: the last minute's load average per core, at least 1. Every
    timeout and bound on time in the suite goes through it, so one set on an idle machine holds on a loaded or slower
    one (tests/README.md, "A loaded machine"); none is an assertion on speed."""
    return seconds * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def run(args: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run a command to completion, capturing output; the caller asserts on returncode and text."""
    return subprocess.run(
        args, cwd=cwd, env=subprocess_env(**env), capture_output=True, text=True, timeout=slack(timeout)
    )


def parallelkit(
    *args: str, cwd: Path, timeout: float = 600, real_launch: bool = False, **env: str
) -> subprocess.CompletedProcess:
    """`parallelkit ARGS` to completion, as `subprocess.run` would report it: its ranks forked from a process that
    imported the CLI once (`launch`), or, `real_launch`, `python -m parallelkit.cli ARGS` with Lightning's own
    launcher (only where the launcher is what a test checks: say why at the call)."""
    if real_launch or not forkable(env):
        return run([sys.executable, "-m", "parallelkit.cli", *args], cwd, timeout, **env)
    return launch(list(args), cwd=cwd, **env).result(timeout)


def torchrun(script: str, nproc: int, *args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """tests/scripts/<script> on `nproc` ranks with torchrun's variables, forked as `launch` forks the CLI's."""
    return launch(list(args), cwd=cwd, script=str(SCRIPTS / script), nprocs=nproc).result(timeout)


def script(name: str, *args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python tests/scripts/<name> ARGS`, forked as `launch` forks the CLI's: a Python-API script whose Trainer
    launches its ranks, or a one-process reference (TRL's trainer, `trl_dpo.py`)."""
    return launch(list(args), cwd=cwd, script=str(SCRIPTS / name)).result(timeout)


def forkable(env: dict[str, str]) -> bool:
    """Whether a job with these extra variables can be forked from the server: not one that changes what the
    interpreter does at start (a `usercustomize` on PYTHONPATH, other PYTHON* settings). PYTHONPATH's entries are put
    on a forked rank's path as the interpreter would, and a `sitecustomize` there is run in the rank as it starts:
    the suite's own (tests/faults) patches functions of modules by attribute, which works on the server's imports
    too (one that needed to run before any import would need `real_launch=True`)."""
    entries = [Path(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    at_start = any((p / "usercustomize.py").exists() for p in entries)
    return not at_start and not any(name.startswith("PYTHON") and name != "PYTHONPATH" for name in env)


@dataclass
class Job:
    """A forked job (tests/scripts/fork_server.py): its leader, in a session of its own (`pid`: signal the whole
    job with `os.killpg(job.pid, ...)`), and its ranks (`ranks()`). Waited for as a `subprocess.Popen` is."""

    pid: int
    directory: Path
    args: list[str]
    returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            status = self.directory / "status"
            if status.exists() or not _alive(self.pid):
                # no status from a leader that is gone: the job was SIGKILLed whole
                self.returncode = int(status.read_text()) if status.exists() else -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status, waited for at most `timeout` seconds (`slack`ed)."""
        timeout = None if timeout is None else slack(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def ranks(self) -> list[int]:
        """The pids of the ranks started so far, by rank."""
        path = self.directory / "ranks"
        return json.loads(path.read_text()) if path.exists() else []

    def session(self) -> list[int]:
        """Every process of the job still alive: the leader and its ranks."""
        return session(self.pid)

    def kill(self, signum: int = signal.SIGKILL) -> None:
        kill_session(self.pid, signum)

    def stdout(self) -> str:
        return (self.directory / "stdout").read_text(errors="replace")

    def stderr(self) -> str:
        return (self.directory / "stderr").read_text(errors="replace")

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait up to `timeout` seconds (then kill the job whole and raise, as `subprocess.run`); the exit status
        and output as `subprocess.run` returns them."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        finally:
            if self.returncode is None:
                self.kill()
        done = subprocess.CompletedProcess(self.args, self.returncode, self.stdout(), self.stderr())
        shutil.rmtree(self.directory, ignore_errors=True)
        return done


def session(leader: int) -> list[int]:
    """The pids of every process still alive in the session `leader` started. Not a zombie: a process that has ended
    and waits only to be reaped (a rank whose parent exited first, until the machine's init reaps it: on a loaded
    machine a SIGKILLed rank's stays listed for a minute)."""
    found = subprocess.run(["pgrep", "-s", str(leader)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found if not _zombie(int(pid))]


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # gone since pgrep saw it
    return stat.rpartition(")")[2].split()[0] == "Z"


def kill_session(leader: int, signum: int = signal.SIGKILL) -> None:
    """`signum` to every process of the session (its process group) `leader` started, if any is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(leader, signum)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


_SERVER: subprocess.Popen | None = None
_JOBS: Path | None = None  # the jobs' directories (output, status, rank pids), one per job


def launch(args: list[str], cwd: Path, script: str | None = None, nprocs: int | None = None, **env: str) -> Job:
    """Start `parallelkit ARGS` (given `script`: `python SCRIPT ARGS`) in `cwd`, forked from this pytest process's
    server, which imported the CLI once (tests/scripts/fork_server.py); returns at once. Lightning's launcher starts
    the other ranks as it does for the real command, or, with `nprocs`, that many ranks start at once with torchrun's
    variables. Each job has its own session, environment (`subprocess_env(**env)`: its own rendezvous port) and
    output files."""
    global _SERVER, _JOBS
    if _JOBS is None:
        _JOBS = Path(tempfile.mkdtemp(prefix="parallelkit-jobs-"))
        atexit.register(shutil.rmtree, _JOBS, ignore_errors=True)
    if _SERVER is None or _SERVER.poll() is not None:
        server = [sys.executable, str(SCRIPTS / "fork_server.py")]
        with open(_JOBS / "server.log", "w") as log:  # what its imports print, kept out of pytest's output
            _SERVER = subprocess.Popen(
                server, env=subprocess_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
            )
        atexit.register(_SERVER.kill)
    directory = Path(tempfile.mkdtemp(dir=_JOBS))
    request = {
        "args": args,
        "cwd": str(cwd),
        "env": subprocess_env(**env),
        "dir": str(directory),
        "script": script,
        "nprocs": nprocs,
    }
    try:
        _SERVER.stdin.write(json.dumps(request) + "\n")
        _SERVER.stdin.flush()
        pid = json.loads(_SERVER.stdout.readline())["pid"]
    except (OSError, ValueError) as err:
        log = (_JOBS / "server.log").read_text(errors="replace")
        raise RuntimeError(f"the fork server (tests/scripts/fork_server.py) failed:\n{log[-4000:]}") from err
    return Job(pid, directory, [script or "parallelkit", *args])


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
    config: str, save_dir: Path, *overrides: str, timeout: float = 600, real_launch: bool = False, **env: str
) -> subprocess.CompletedProcess:
    """`parallelkit fit --config configs/<config>` logging CSV under `save_dir`, quietly (`real_launch`: see
    parallelkit)."""
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
        real_launch=real_launch,
        **env,
    )


def in_repo(args: list[str]) -> list[str]:
    """A manual's command words with its `configs/...` paths made the repository's, for a test run elsewhere."""
    return [str(REPO / arg) if arg.startswith("configs/") else arg for arg in args]


def fit_command(args: list[str], save_dir: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    """A manual's `parallelkit fit ...` command (its words after `parallelkit`: `snippets.parallelkit_args`) as
    `fit` runs a config: its `configs/` paths from the repository, CSV logs under `save_dir`, then `overrides`."""
    assert args[0] == "fit", args
    args = in_repo(args)
    at = args.index("--config")  # the first config, which `fit` gives first
    return fit(args[at + 1], save_dir, *args[1:at], *args[at + 2 :], *overrides, **env)


STEPS = 6
"""A parity run's length: every one of its steps' losses compared with one process's. Six steps show what ten and
twenty did (a layout that differs from one process differs from the first step, and its difference grows), and
steps are most of a forked run's cost (tests/README.md)."""

LEARNED = 0.5
"""How far a parity run's loss falls over its `STEPS` steps at least ("it learns"): one process goes from 5.59 to 5.00
on the suite's corpus in 6 steps of the configs' 10-step warmup."""

ROOM = 10
"""The length of a run a test signals or kills while it trains: room for a checkpoint, the fault after it and steps
left to stop at, however slowly a loaded machine gets the signal to the ranks (`STEPS` leave too few). The configs'
warmup is 10 steps: its first `STEPS` steps are a parity run's."""

RESUME_AT = STEPS // 2
"""The step the shared reference runs checkpoint at, which the resume tests start from."""


def common(corpus: Path, cache: Path, steps: int = STEPS) -> list[str]:
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


FIRST_BATCH = callback("models.FirstBatch", out_dir="first_batch")
"""Rank 0's first training batch written under the run's cwd (a `reference` run's `log`): `assert_own_tokenizer`."""


def guide_command(name: str, config: str, pretrained: Path, *overrides: str) -> tuple[str, ...]:
    """The overrides of a guide's fine-tuning command (snippet `name`: `parallelkit fit --config CONFIG ...` on
    `/data/Llama-3.2-1B` and `/data/my_text`) for `pretrained`, without its text: the caller gives the suite's."""
    from snippets import parallelkit_args

    command, flag, named, *args = parallelkit_args(name, 0, **{"/data/Llama-3.2-1B": str(pretrained)})
    assert (command, flag, named) == ("fit", "--config", config), (command, flag, named)
    return (*(arg for arg in args if arg != "--data.init_args.paths=/data/my_text"), *overrides)


def assert_own_tokenizer(log: Path, model_dir: Path, corpus: Path, seq_len: int) -> None:
    """Each sample of the first batch a run under `log` trained on (`FIRST_BATCH`) is a window of the tokenizer in
    `model_dir` encoding `corpus` (the one document) followed by its EOS: the model was fed its own ids."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = json.loads((model_dir / "tokenizer_config.json").read_text())["eos_token"]
    ids = [*tokenizer.encode(corpus.read_text()).ids, tokenizer.token_to_id(eos)]
    windows = {tuple(ids[start : start + seq_len]) for start in range(0, len(ids) - seq_len, seq_len)}
    batch = json.loads((log / "first_batch" / "rank0.json").read_text())
    assert batch and all(len(sample) == seq_len and tuple(sample) in windows for sample in batch), batch
    assert list(corpus.read_bytes()[:seq_len]) != ids[:seq_len]  # the tokenizer is not bytes


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


SFT_ONE_PROCESS = ("--trainer.strategy=auto", "--trainer.devices=1", "--data.init_args.batch_size=8")
"""configs/sft.yaml as one process with its global batch of 8 rows (`sft_runs`' reference)."""

SFT_GPT = (
    "--model=parallelkit.models.GPT",
    "--model.init_args.vocab_size=264",
    "--model.init_args.n_layer=2",
    "--model.init_args.n_head=4",
    "--model.init_args.n_embd=64",
)
"""The reference GPT on configs/sft.yaml's data: its own mask and rotary positions (a pipeline's second stage first
runs on placeholder positions to learn shapes, which the positions' rotary angles must survive)."""


SINGLE_PROCESS = {
    "plain": (),
    "accumulate": ("--trainer.accumulate_grad_batches=2",),
    "clip": ("--trainer.gradient_clip_val=0.05",),
    "val": (f"--trainer.val_check_interval={RESUME_AT}", "--trainer.limit_val_batches=3"),
}
"""The single-process baselines parity tests compare with, by name: overrides of configs/single.yaml."""


@dataclass(frozen=True)
class Reference:
    """A finished run of `STEPS` steps that checkpointed at step `RESUME_AT`."""

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
