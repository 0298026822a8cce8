"""parallelkit-diloco, tested as its users run it: installed with pip, selected by name, launched by the CLI (its ranks
forked by the repository's test harness, tests/README.md; the install tests start fresh interpreters)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import parallelkit

TESTS = Path(__file__).resolve().parent
PLUGIN = TESTS.parent
REPO = Path(parallelkit.__file__).resolve().parents[2]
CONFIG = PLUGIN / "configs" / "diloco.yaml"
DDP_CONFIG = REPO / "configs" / "ddp.yaml"
PARAMS = 131_392  # the configs' GPT (n_layer=2, n_embd=64, byte vocabulary)

sys.path.insert(0, str(REPO / "tests"))
from support import launch, step_losses  # noqa: E402
from support import parallelkit as cli  # noqa: E402 - the repository's harness: ranks forked from a warm process


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # This directory on the path, so that runs can name diloco_callbacks' classes by class_path.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    return proc


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def fit(config: Path, out: Path, corpus: Path, *overrides: str) -> dict[str, dict[int, float]]:
    """`parallelkit fit` (forked ranks, this directory on their path for diloco_callbacks); returns every logged
    metric by step."""
    out.mkdir(parents=True)
    ok(
        cli(
            "fit",
            f"--config={config}",
            f"--trainer.logger.init_args.save_dir={out}",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--trainer.limit_val_batches=0",
            f"--data.init_args.paths={corpus}",
            f"--data.init_args.cache_dir={out.parent / 'cache'}",
            "--trainer.callbacks+=parallelkit.callbacks.CommunicationMonitor",
            *overrides,
            cwd=out,
            PYTHONPATH=str(TESTS),
        )
    )
    (metrics,) = out.rglob("metrics.csv")
    values: dict[str, dict[int, float]] = {}
    with open(metrics) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value and key not in ("epoch", "step"):
                    values.setdefault(key, {})[int(row["step"])] = float(value)
    return values


SGD = ["--optimizer=torch.optim.SGD", "--optimizer.lr=0.1"]
LOCAL_SGD_EVERY_STEP = [
    "--trainer.strategy.sync_every=1",
    "--trainer.strategy.outer_lr=1.0",
    "--trainer.strategy.outer_momentum=0.0",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The first 400 KB of the standard library sources parallelkit's default data reads. Not parallelkit's own
    source (as it once was): every edit to it changed the data, and with it how far DiLoCo's outer step (equal to
    DDP's step in exact arithmetic, not in rounding) drifted from DDP by step 16."""
    from parallelkit.data.text import default_corpus_files

    text, files = "", iter(default_corpus_files())
    while len(text) < 400_000:
        text += next(files).read_text()
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text[:400_000])
    return path


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, corpus) -> dict[str, dict[int, float]]:
    """Lightning's DDP on 2 processes, inner SGD, 16 steps: the algorithm DiLoCo with sync_every=1 must equal."""
    return fit(DDP_CONFIG, tmp_path_factory.mktemp("ddp") / "run", corpus, "--trainer.max_steps=16", *SGD)


def assert_same(expected: dict[int, float], actual: dict[int, float], rtol: float) -> None:
    assert sorted(expected) == sorted(actual)
    for step, value in expected.items():
        assert abs(actual[step] - value) <= rtol * abs(value), (step, value, actual[step])


def test_diloco_every_step_with_plain_outer_sgd_is_ddp(tmp_path, corpus, ddp):
    diloco = fit(CONFIG, tmp_path / "run", corpus, "--trainer.max_steps=16", *SGD, *LOCAL_SGD_EVERY_STEP)
    assert_same(ddp["train_loss"], diloco["train_loss"], rtol=1e-5)
    assert diloco["train_loss"][15] < diloco["train_loss"][0] - 0.5


def test_replicas_sharded_over_fsdp_are_still_ddp(tmp_path, corpus, ddp):
    diloco = fit(
        CONFIG,
        tmp_path / "run",
        corpus,
        "--trainer.max_steps=16",
        *SGD,
        *LOCAL_SGD_EVERY_STEP,
        '--trainer.strategy.mesh_shape=[[2, 2], ["replicate", "fsdp"]]',
        "--trainer.devices=4",
        "--data.init_args.batch_size=2",
    )
    assert_same(ddp["train_loss"], diloco["train_loss"], rtol=1e-5)


def test_sync_every_8_sends_an_eighth_of_ddps_data_parallel_bytes(tmp_path, corpus, ddp):
    """Also: parallelkit's ReplicaMonitor, every 2 steps and raising on a mismatch, leaves the replicas alone between
    synchronisations (they differ by design) and finds them equal right after each (steps 8 and 16)."""
    replicas = (
        '--trainer.callbacks+={"class_path": "parallelkit.callbacks.ReplicaMonitor", '
        '"init_args": {"every_n_steps": 2, "on_mismatch": "raise"}}'
    )
    diloco = fit(CONFIG, tmp_path / "run", corpus, "--trainer.max_steps=16", *SGD, replicas)
    compared = diloco["replicas/compared"]
    assert compared[7] == compared[15] > 0 and {compared[s] for s in (1, 3, 5, 9, 11, 13)} == {0.0}, compared
    ddp_bytes = sum(ddp["comm/all_reduce_bytes"].values())
    diloco_bytes = diloco["comm/all_reduce_bytes"]
    # Every step all-reduces the 4-byte logged loss; steps 8 and 16 also all-reduce every parameter once.
    assert {step for step, b in diloco_bytes.items() if b > 4} == {7, 15}
    assert diloco_bytes[7] == 4.0 * PARAMS + 4
    assert sum(diloco_bytes.values()) / ddp_bytes == pytest.approx(1 / 8, rel=0.02)
    assert diloco["train_loss"][15] < diloco["train_loss"][0] - 0.5


def test_bf16_outer_communication_halves_the_sync_bytes(tmp_path, corpus):
    diloco = fit(
        CONFIG, tmp_path / "run", corpus, "--trainer.max_steps=8", *SGD, "--trainer.strategy.outer_comm_precision=bf16"
    )
    assert diloco["comm/all_reduce_bytes"][7] == 2.0 * PARAMS + 4


# Outer momentum on, so that a resume which restarted the outer loop would show; 2 replicas, a sync every 4 steps.
WINDOWS = ["--trainer.max_steps=12", "--trainer.strategy.sync_every=4", "--trainer.strategy.outer_momentum=0.5"]


def keep_checkpoints_in(dirpath: Path) -> str:
    """A ModelCheckpoint that saves nothing by itself: the SIGTERM save writes last.ckpt to its dirpath, where
    `--ckpt_path=last` looks (the default callback's dirpath changes with the logger's version)."""
    return (
        '--trainer.callbacks+={"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", '
        f'"init_args": {{"dirpath": "{dirpath}", "every_n_train_steps": 1000}}}}'
    )


@pytest.fixture(scope="module")
def windows(tmp_path_factory, corpus) -> tuple[dict[int, float], Path]:
    """The WINDOWS run uninterrupted: its per-step losses, and the directory where diloco_callbacks.RecordSyncs wrote
    each rank's starting weights and its weights before and after each of the 3 synchronisations (steps 3, 7, 11)."""
    root = tmp_path_factory.mktemp("windows")
    syncs = root / "syncs"
    record = (
        f'--trainer.callbacks+={{"class_path": "diloco_callbacks.RecordSyncs", "init_args": {{"dirpath": "{syncs}"}}}}'
    )
    return fit(CONFIG, root / "run", corpus, *WINDOWS, record)["train_loss"], syncs


def test_outer_step_is_nesterov_sgd_on_the_replicas_mean_pseudo_gradient(windows):
    """Every synchronisation of the WINDOWS run, written out by hand from the two replicas' weights: the pseudo-
    gradient g = anchor - mean(replica weights); the momentum buffer b = g at the first sync, then b = mu b + g;
    Nesterov's step: new anchor = anchor - lr (g + mu b); both replicas continue from it."""
    _, syncs = windows
    lr, mu = 0.7, 0.5  # diloco.yaml's outer_lr; WINDOWS' outer_momentum
    anchor, other = (torch.load(syncs / f"rank{rank}_start.pt") for rank in (0, 1))
    assert anchor.keys() == other.keys() and all(torch.equal(anchor[k], other[k]) for k in anchor)  # the first anchor
    momentum: dict[str, torch.Tensor] = {}
    for step in (3, 7, 11):
        replicas = [torch.load(syncs / f"rank{rank}_sync{step}.pt") for rank in (0, 1)]
        assert not torch.equal(replicas[0]["before"]["head.weight"], replicas[1]["before"]["head.weight"])
        for name, start in anchor.items():
            g = start.double() - sum(r["before"][name].double() for r in replicas) / 2
            momentum[name] = g if step == 3 else mu * momentum[name] + g
            expected = start.double() - lr * (g + mu * momentum[name])
            for replica in replicas:  # fp32 rounding at weights up to ~1: measured 6e-8 off; without Nesterov, 1e-3
                torch.testing.assert_close(replica["after"][name].double(), expected, rtol=0, atol=2e-7)
        anchor = replicas[0]["after"]
    assert sorted(p.name for p in syncs.glob("rank*_sync*.pt")) == [
        f"rank{r}_sync{s}.pt" for r in (0, 1) for s in (11, 3, 7)
    ]


def test_sigterm_between_syncs_saves_last_and_the_relaunch_continues_exactly(tmp_path, corpus, windows):
    """Preempted after step 6 (SIGTERM to every rank), between the syncs of steps 4 and 8, when the replicas' weights
    and inner optimizers differ and the outer momentum holds a sync's worth: the ranks agree to stop at the end of
    the next step (their agreement is read one step late, so as not to wait for it), save last.ckpt and exit 0, and
    the relaunch trains steps 7-11 with the uninterrupted run's losses."""
    straight, _ = windows
    ckpt = tmp_path / "ckpt"
    sigterm = '--trainer.callbacks+={"class_path": "diloco_callbacks.SigtermAt", "init_args": {"step": 6}}'
    first = fit(CONFIG, tmp_path / "first", corpus, *WINDOWS, keep_checkpoints_in(ckpt), sigterm)["train_loss"]
    assert (ckpt / "last.ckpt" / "meta.pt").is_file() and sorted(first) == list(range(7))
    resumed = fit(CONFIG, tmp_path / "resumed", corpus, *WINDOWS, keep_checkpoints_in(ckpt), "--ckpt_path=last")
    assert sorted(resumed["train_loss"]) == list(range(7, 12))
    assert_same({s: straight[s] for s in range(7, 12)}, resumed["train_loss"], rtol=1e-6)


def test_over_replica_groups_a_killed_group_costs_only_its_inner_steps(tmp_path, corpus):
    """WINDOWS' run as 2 replica groups of one process each (each group a replica, no replicate axis; torchft's
    quorum at each synchronisation, steps 3, 7 and 11). Group 1 SIGKILLed as its step 5 starts, between the first
    and second synchronisation: group 0 trains on, never failing, and each of its synchronisations is the outer step
    written out by hand over the groups that took part (both at step 3; group 0 alone at 7 and 11, after the
    lighthouse's 1 s heartbeat timeout): group 1's inner steps 4-5 are all the job lost."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=1000)
    address = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    logs, syncs = [tmp_path / f"group{g}" for g in (0, 1)], [tmp_path / f"syncs{g}" for g in (0, 1)]
    kill = (
        '--trainer.callbacks+={"class_path": "models.KillGroupAt", "init_args": {"step": 5, "when": "between_steps"}}'
    )
    jobs = []
    try:
        for g in (0, 1):
            logs[g].mkdir()
            record = {"class_path": "diloco_callbacks.RecordSyncs", "init_args": {"dirpath": str(syncs[g])}}
            command = [
                "fit",
                f"--config={CONFIG}",
                '--trainer.strategy.mesh_shape=[[1], ["fsdp"]]',
                "--trainer.devices=1",
                f"--trainer.strategy.replica_groups.group={g}",
                "--trainer.strategy.replica_groups.num_groups=2",
                f"--trainer.strategy.replica_groups.lighthouse={address}",
                "--trainer.strategy.replica_groups.hostname=127.0.0.1",
                f"--trainer.logger.init_args.save_dir={logs[g]}",
                "--trainer.enable_progress_bar=false",
                "--trainer.limit_val_batches=0",
                f"--data.init_args.paths={corpus}",
                f"--data.init_args.cache_dir={tmp_path / 'cache'}",
                f"--trainer.callbacks+={json.dumps(record)}",
                *WINDOWS,
                *([kill] if g == 1 else []),
            ]
            jobs.append(launch(command, cwd=logs[g], PYTHONPATH=str(TESTS)))
        assert jobs[1].wait(timeout=300) == -signal.SIGKILL, jobs[1].stderr()[-3000:]
        assert jobs[0].wait(timeout=300) == 0, jobs[0].stderr()[-3000:]
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
        server.shutdown()
    participants, committed = (step_losses(logs[0], f"ft/{key}") for key in ("participants", "committed_steps"))
    assert [(participants[s], committed[s]) for s in (3, 7, 11)] == [(2.0, 1.0), (1.0, 2.0), (1.0, 3.0)]
    lr, mu = 0.7, 0.5
    anchor, other = (torch.load(syncs[g] / "rank0_start.pt") for g in (0, 1))
    assert all(torch.equal(anchor[k], other[k]) for k in anchor)  # both groups start from the same weights
    momentum: dict[str, torch.Tensor] = {}
    for step, groups in ((3, (0, 1)), (7, (0,)), (11, (0,))):
        records = [torch.load(syncs[g] / f"rank0_sync{step}.pt") for g in groups]
        for name, start in anchor.items():
            g = start.double() - sum(r["before"][name].double() for r in records) / len(records)
            momentum[name] = g if step == 3 else mu * momentum[name] + g
            expected = start.double() - lr * (g + mu * momentum[name])
            for record in records:
                torch.testing.assert_close(record["after"][name].double(), expected, rtol=0, atol=2e-7)
        anchor = records[0]["after"]
    assert not (syncs[1] / "rank0_sync7.pt").exists()


def test_mesh_without_replicate_axis_is_refused_with_a_fix(tmp_path):
    proc = cli("fit", f"--config={CONFIG}", '--trainer.strategy.mesh_shape=[[2], ["fsdp"]]', cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "needs a 'replicate' axis" in proc.stderr and '[[2], ["replicate"]]' in proc.stderr


LIST_PLUGINS = (
    "import contextlib\nfrom parallelkit.cli import main\n"
    "with contextlib.suppress(SystemExit):\n    main(['plugins'])\n"
)
"""`parallelkit plugins` run by a script that already imported parallelkit (one fresh interpreter per install state)."""


def test_registered_by_name_and_listed_with_its_distribution(tmp_path):
    code = (
        "import lightning as L, parallelkit\n"
        "t = L.Trainer(strategy='diloco', accelerator='cpu', devices=2, logger=False)\n"
        "print(type(t.strategy).__name__, t.strategy.mesh_spec, t.strategy.sync_every)\n"
    )
    out = ok(run(sys.executable, "-c", code + LIST_PLUGINS, cwd=tmp_path)).stdout
    assert 'DiLoCoStrategy [[2, 1, 1], ["replicate", "fsdp", "tp"]] 8' in out
    assert any("diloco" in line and "parallelkit-diloco 0.1.0" in line for line in out.splitlines())


def test_uninstalling_removes_the_strategy_and_reinstalling_brings_it_back(tmp_path):
    """Last in this file: it really uninstalls the plugin from this environment, then reinstalls it."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    code = "import lightning as L, parallelkit\nL.Trainer(strategy='diloco', accelerator='cpu', devices=2)\n"
    ok(run(*pip, "uninstall", "-y", "parallelkit-diloco", cwd=tmp_path))
    try:
        listing = run(sys.executable, "-c", LIST_PLUGINS + code, cwd=tmp_path)  # lists, then fails on the name
    finally:
        ok(run(*pip, "install", "--no-deps", "--no-build-isolation", "-e", str(PLUGIN), cwd=tmp_path))
    assert listing.returncode != 0 and "invalid strategy name: `strategy='diloco'`" in listing.stderr
    assert "fsdp_tp" in listing.stdout and "diloco" not in listing.stdout
    ok(run(sys.executable, "-c", code, cwd=tmp_path))
