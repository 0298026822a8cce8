"""Checkpoints: load across layouts, consolidate to one file, refuse what does not fit, survive crashes."""

import contextlib
import csv
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from snippets import commands
from support import (
    REPO,
    RESUME_AT,
    ROOM,
    STEPS,
    assert_ok,
    assert_same_losses,
    callback,
    checkpoint_every,
    common,
    fit,
    kill_session,
    launch,
    parallelkit,
    run,
    session,
    slack,
    step_losses,
    subprocess_env,
)

from parallelkit.data import TextDataModule
from parallelkit.models import GPT


@pytest.fixture(scope="module")
def saved(reference):
    """A [[2, 2]] run of `STEPS` steps that checkpoints at step `RESUME_AT`: (its losses, that checkpoint)."""
    run = reference("hybrid.yaml")
    return run.losses(), run.checkpoint


@pytest.mark.parametrize(
    ("name", "config", "layout"),
    [
        (
            "fsdp4",
            "hybrid.yaml",
            [
                "--trainer.devices=4",
                '--trainer.strategy.mesh_shape=[[4, 1], ["fsdp", "tp"]]',
                "--data.init_args.batch_size=2",
            ],
        ),
        (
            "tp2",
            "hybrid.yaml",
            [
                "--trainer.devices=2",
                '--trainer.strategy.mesh_shape=[[1, 2], ["fsdp", "tp"]]',
                "--data.init_args.batch_size=8",
            ],
        ),
        (
            "one_process",
            "hybrid.yaml",
            ["--trainer.devices=1", '--trainer.strategy.mesh_shape=[[1], ["fsdp"]]', "--data.init_args.batch_size=8"],
        ),
        ("1f1b_pp2", "1f1b.yaml", []),
    ],
)
def test_2x2_checkpoint_loads_in_another_layout_with_the_same_next_losses(
    tmp_path, corpus, saved, name, config, layout
):
    losses, ckpt = saved
    assert_ok(
        fit(
            config,
            tmp_path,
            *common(corpus, tmp_path / "cache"),
            f"--trainer.max_steps={RESUME_AT + 2}",
            f"--ckpt_path={ckpt}",
            *layout,
        )
    )
    assert_same_losses({step: losses[step] for step in (RESUME_AT, RESUME_AT + 1)}, step_losses(tmp_path))


def test_consolidated_weights_are_the_saving_runs_weights(tmp_path, corpus, saved):
    """The plain model with the consolidated weights of the step-`RESUME_AT` checkpoint computes the loss the [[2, 2]]
    run logged at that step (its forward with exactly those weights), on the same global batch: a tensor DCP left
    unfilled (consolidate starts from torch.empty) or a shard put in the wrong place changes it."""
    losses, ckpt = saved
    out = tmp_path / "weights.pt"
    assert_ok(parallelkit("consolidate", str(ckpt), str(out), cwd=tmp_path))
    weights = torch.load(out, weights_only=True)
    model = GPT(n_layer=2, n_head=4, n_embd=64)
    model.load_state_dict(weights)  # strict: every name and shape matches the unparallelised model
    data = TextDataModule(paths=str(corpus), seq_len=64, batch_size=8, cache_dir=str(tmp_path / "cache"))
    data.prepare_data()
    data.setup("fit")
    x, y = next(itertools.islice(data.train_dataloader(), RESUME_AT, None))  # one process: the whole global batch
    with torch.no_grad():
        loss = model.pipeline_loss(model(x), y).item()
    assert loss == pytest.approx(losses[RESUME_AT], rel=1e-5)


def top_k(dirpath: Path, k: int, mode: str, last: bool = False) -> str:
    """A ModelCheckpoint callback, as a CLI override, keeping the `k` best checkpoints by val_loss (score in the
    name)."""
    return callback(
        "lightning.pytorch.callbacks.ModelCheckpoint",
        dirpath=str(dirpath),
        monitor="val_loss",
        mode=mode,
        save_top_k=k,
        filename="{step}-{val_loss:.5f}",
        save_last=last,
    )


def kept(dirpath: Path) -> dict[float, Path]:
    """The checkpoints ModelCheckpoint left in `dirpath`, by the val_loss in their names; each a complete DCP
    directory."""
    found = {float(p.name.removesuffix(".ckpt").split("val_loss=")[1]): p for p in dirpath.glob("step=*")}
    for path in found.values():
        assert path.is_dir() and (path / ".metadata").is_file() and (path / "meta.pt").is_file(), path
    assert not list(dirpath.glob("*.partial")) and not list(dirpath.glob("*.old"))
    return found


def test_save_top_k_keeps_the_k_best_checkpoint_directories_by_val_loss(tmp_path, corpus):
    """ModelCheckpoint(monitor="val_loss", save_top_k=k) with sharded checkpoints on [[2, 1]], validating every 2
    steps: one callback keeps the 2 lowest val_loss, another (mode="max") the highest, so what is kept follows the
    score and not recency, and every other directory is removed. Its best_model_path names the best one; a relaunch
    from `last` restores the callbacks' state (the kept set stays the best of every validation, before and after);
    and the best path holds the weights that scored it."""
    ckpt = tmp_path / "ckpt"
    layout = ["--trainer.devices=2", '--trainer.strategy.mesh_shape=[[2, 1], ["fsdp", "tp"]]']
    run = [
        *common(corpus, tmp_path / "cache", steps=8),
        *layout,
        "--trainer.val_check_interval=2",  # not 1: Lightning reads val_check_interval == 1.0 as once per epoch
        "--trainer.limit_val_batches=1",
        top_k(ckpt / "min", 2, "min", last=True),
        top_k(ckpt / "max", 1, "max"),
    ]
    assert_ok(fit("hybrid.yaml", tmp_path / "first", *run))
    scores = sorted(round(v, 5) for v in step_losses(tmp_path / "first", "val_loss").values())
    assert len(scores) == 4 and len(set(scores)) == 4
    best = kept(ckpt / "min")
    assert sorted(best) == scores[:2]
    assert list(kept(ckpt / "max")) == scores[-1:]
    assert (ckpt / "min" / "last.ckpt" / ".metadata").is_file()
    meta = torch.load(ckpt / "min" / "last.ckpt" / "meta.pt", weights_only=True)
    (state,) = (v for k, v in meta["callbacks"].items() if "'mode': 'min'" in k)
    assert Path(state["best_model_path"]) == best[scores[0]]
    assert sorted(Path(p) for p in state["best_k_models"]) == sorted(best.values())

    assert_ok(fit("hybrid.yaml", tmp_path / "resumed", *run, "--trainer.max_steps=10", "--ckpt_path=last"))
    assert sorted(step_losses(tmp_path / "resumed")) == [8, 9]
    scores = sorted([*scores, *(round(v, 5) for v in step_losses(tmp_path / "resumed", "val_loss").values())])
    assert len(scores) == 5
    assert sorted(kept(ckpt / "min")) == scores[:2]
    assert list(kept(ckpt / "max")) == scores[-1:]

    (worst,) = kept(ckpt / "max").items()  # step 2's, the earliest: not the weights `last` holds
    (tmp_path / "validate").mkdir()
    validate = parallelkit(
        "validate",
        "--config",
        str(REPO / "configs" / "hybrid.yaml"),
        f"--trainer.logger.init_args.save_dir={tmp_path / 'validate'}",
        "--trainer.enable_progress_bar=false",
        *layout,
        "--trainer.limit_val_batches=1",
        f"--data.init_args.paths={corpus}",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
        f"--ckpt_path={worst[1]}",
        cwd=tmp_path / "validate",
    )
    assert_ok(validate)
    (score,) = step_losses(tmp_path / "validate", "val_loss").values()
    assert score == pytest.approx(worst[0], abs=1e-5)


def test_checkpoint_of_another_model_shape_names_the_mismatched_parameters(tmp_path, corpus, saved):
    _, ckpt = saved
    proc = fit(
        "hybrid.yaml",
        tmp_path,
        *common(corpus, tmp_path / "cache"),
        f"--ckpt_path={ckpt}",
        "--model.init_args.n_embd=32",
        "--trainer.devices=1",  # the [[2, 2]] checkpoint meets one process: the check is the same on any layout
        '--trainer.strategy.mesh_shape=[[1, 1], ["fsdp", "tp"]]',
    )
    assert proc.returncode != 0
    assert "does not fit GPT: tok_emb.weight is (256, 64) in the checkpoint but (256, 32) in the model" in proc.stderr


def test_sharded_checkpoint_with_a_single_device_strategy_says_how_to_load_it(tmp_path, corpus, saved):
    _, ckpt = saved
    proc = fit("single.yaml", tmp_path, *common(corpus, tmp_path / "cache"), f"--ckpt_path={ckpt}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "is a sharded checkpoint" in proc.stderr and "parallelkit consolidate" in proc.stderr


@pytest.fixture(scope="module")
def resumed_2x2(tmp_path_factory, corpus, saved):
    """The shared [[2, 2]] run resumed from its step-`RESUME_AT` checkpoint, to its end, with `--ckpt_path=last`
    next to what a process killed mid-save leaves behind: the checkpoint under the name `last.ckpt`, and shards under
    the staging name `last.ckpt.partial`, newer than it. One launch for the two tests below (the resume-mid-epoch
    one and the cut-short-save one each launched it before): the resumed steps' losses."""
    root = tmp_path_factory.mktemp("resumed_2x2")
    ckpt = root / "ckpt"
    ckpt.mkdir()
    shutil.copytree(saved[1], ckpt / "last.ckpt")
    partial = ckpt / "last.ckpt.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"truncated")
    # A ModelCheckpoint on the directory (`last` is found through it) that saves nothing before the run ends.
    watch = checkpoint_every(ckpt, 100, last=True)
    assert_ok(fit("hybrid.yaml", root / "resumed", *common(corpus, root / "cache"), watch, "--ckpt_path=last"))
    return step_losses(root / "resumed")


def test_a_save_cut_short_is_ignored_and_last_resumes_from_the_complete_one(saved, resumed_2x2):
    """`--ckpt_path=last` next to what a process killed mid-save leaves behind (shards under the staging name
    `last.ckpt.partial`, newer than `last.ckpt`) resumes from the complete `last.ckpt`: here the shared [[2, 2]]
    run's step-`RESUME_AT` checkpoint under that name."""
    resumed = resumed_2x2
    assert sorted(resumed) == list(range(RESUME_AT, STEPS))  # from the complete checkpoint's step on
    assert_same_losses({step: saved[0][step] for step in resumed}, resumed)


@dataclass
class RealLaunch:
    """A job `training_in_background` started with Lightning's own launcher: the `parallelkit` process (rank 0,
    whose children are the other ranks), in a session of its own, and its stderr as a file (a pipe nobody reads while
    the test waits fills with 4 ranks' tracebacks and blocks them). Waited for and signalled as a forked `Job`."""

    process: subprocess.Popen
    stderr_path: Path

    def __getattr__(self, name: str):  # poll, wait, returncode, pid
        return getattr(self.process, name)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def session(self) -> list[int]:
        return session(self.pid)

    def kill(self, signum: int = signal.SIGKILL) -> None:
        kill_session(self.pid, signum)


@contextlib.contextmanager
def training_in_background(
    tmp_path, corpus, save_dir, *overrides: str, until: Path, config: str = "hybrid.yaml", real_launch: bool = False
):
    """A `ROOM`-step run of configs/<config> (4-process hybrid by default), forked (`support.launch`: `Job`) or,
    `real_launch`, through `python -m parallelkit.cli` (`RealLaunch`), yielded once `until` exists; killed whole if
    left running."""
    args = [
        "fit",
        "--config",
        str(REPO / "configs" / config),
        *common(corpus, tmp_path / "cache", steps=ROOM),
        f"--trainer.logger.init_args.save_dir={save_dir}",
        "--trainer.enable_progress_bar=false",
        *overrides,
    ]
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    if real_launch:
        stderr_path = Path(save_dir) / "stderr.txt"
        with open(stderr_path, "w") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", "parallelkit.cli", *args],
                cwd=tmp_path,
                env=subprocess_env(),
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )
        job = RealLaunch(process, stderr_path)
    else:
        job = launch(args, cwd=tmp_path)
    try:
        deadline = time.time() + slack(300)
        while not until.exists():
            assert job.poll() is None and time.time() < deadline, f"training never produced {until}\n{job.stderr()}"
            time.sleep(0.1)
        yield job
    finally:
        if job.poll() is None:
            job.kill()
        job.wait()


FSDP2 = [
    "--trainer.devices=2",
    '--trainer.strategy.mesh_shape=[[2, 1], ["fsdp", "tp"]]',
    "--data.init_args.batch_size=4",
]
"""hybrid.yaml on [[2, 1]]: 2 processes, the same global batch of 8."""


FAULT_STEPS = 20
"""The length of the runs a fault interrupts: room for a checkpoint, a kill after it, and a relaunch's own crash and
restart after that."""


@pytest.fixture(scope="module")
def straight_fsdp2(reference):
    """The uninterrupted run on [[2, 1]], `FAULT_STEPS` long: what the fault tests that need no more than 2 processes
    (SIGTERM, SIGKILL mid-save) compare their relaunches with, at 1e-6 as the same layout gives. Those tests ran on
    [[2, 2]]; a 2-process launch costs about half of a 4-process one on the CI's 2 cores. Its first `STEPS` steps
    are those of a shorter run (the LR schedule's warmup is 10 steps)."""
    return reference("hybrid.yaml", *FSDP2, f"--trainer.max_steps={FAULT_STEPS}").losses()


@pytest.fixture(scope="module")
def straight_one(reference):
    """One process, `FAULT_STEPS` long (test_replica_groups.py's too): what the relaunches of the layouts a signal
    stops (DDP, a pipeline, tp) continue, at 1e-5 as each layout equals one process. Its first `ROOM` steps are
    those of a run that long (the LR schedule's warmup is 10 steps)."""
    return reference("single.yaml", f"--trainer.max_steps={FAULT_STEPS}").losses()


KILLED_RANK_BOUND_S = 20.0
"""How long every rank of a job may take to end after one is SIGKILLed, under the default collective
timeout (1800 s). gloo reports the closed connection at once (measured: 1.8 s on 2 loaded cores), and Lightning's
launcher SIGKILLs the other ranks within its 5 s poll once a child has died; the bound (`slack`ed: times the load per
core) leaves room for a loaded machine and is far below any timeout."""


@dataclass
class KilledThenRestarted:
    """What `killed_then_restarted` saw: how the job whose rank was killed ended, and the relaunch's logs."""

    ended_after: float  # seconds from the kill until no process of the job was left (or the bound ran out)
    left_running: list[str]  # the job's processes still alive then
    returncode: int | None  # the launcher's exit status
    stderr: str
    relaunch: subprocess.CompletedProcess  # torchrun --max-restarts=1, crashed once more and restarted
    crashed: Path  # the marker the relaunch's crash left
    logs: Path  # the relaunch's CSV logs: version_0 its first attempt, version_1 the restarted one


@pytest.fixture(scope="module")
def killed_then_restarted(tmp_path_factory, corpus):
    """One fault sequence on [[2, 1]] (2 processes: a sharded job at half a [[2, 2]] one's cost, the same faults)
    shared by the two tests below (each launched both of its runs before). Both launches are real: how Lightning's
    launcher and torchrun end and restart ranks is what they check.

    1. hybrid.yaml through `python -m parallelkit.cli`; rank 1 is SIGKILLed at step 7 under the default timeout
       (checkpoints every 5 steps, so `last` is step 5); the job is watched until every process is gone or
       KILLED_RANK_BOUND_S has passed, then killed whole.
    2. The relaunch with `--ckpt_path=last`, by `torchrun --max-restarts=1` as the checkpoints guide says (c10d
       rendezvous, the rendezvous store not shared with the process group: torch 2.13 with gloo otherwise hands a
       restarted worker the previous attempt's peer addresses, "Gloo connectFullMesh failed ... Connection refused";
       pytorch/pytorch#135712). Its first attempt resumes from step 5 and trains steps 5-9 (checkpointing every 4:
       step 8); rank 1 dies at step 10; torchrun restarts both workers, which resume from step 8 and finish. The
       CSV logger writes every step, so the first attempt's steps are on disk when it is killed.
    """
    root = tmp_path_factory.mktemp("killed_then_restarted")
    ckpt, killed, crashed = root / "ckpt", root / "killed", root / "crashed"
    crash = callback("models.CrashOnce", step=7, marker=str(killed))
    # max_steps as the uninterrupted run (the LR schedule depends on it); the crash comes long before it.
    overrides = [f"--trainer.max_steps={FAULT_STEPS}", *FSDP2, checkpoint_every(ckpt, 5, last=True), crash]
    # Lightning's own launcher: how it and gloo end the other ranks is what the test checks (a forked job's leader
    # would end them itself).
    with training_in_background(root, corpus, root / "first", *overrides, until=killed, real_launch=True) as job:
        killed_at = killed.stat().st_mtime  # touched by rank 1 just before it SIGKILLs itself
        bound = slack(KILLED_RANK_BOUND_S)
        while job.session() and time.time() - killed_at < bound:
            time.sleep(0.1)
        ended_after = time.time() - killed_at
        left_running = job.session()
        # Every process ended: its exit status is collected (a process in the middle of exiting is no longer listed
        # but not yet waitable: `poll` could still say None). Else what it is now.
        returncode = job.poll() if left_running else job.wait(timeout=30)
    # The relaunch command of docs/guides/checkpoints.md, at this job's scale.
    ((variable, launcher, *command),) = commands("torchrun-restarts")
    assert (variable, launcher) == ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "torchrun")
    scale = {
        "--nproc-per-node=4": "--nproc-per-node=2",
        "--max-restarts=3": "--max-restarts=1",
        # the rendezvous store binds a free port itself: none chosen here to lose
        "--rdzv-endpoint=127.0.0.1:29500": "--rdzv-endpoint=127.0.0.1:0",
        "configs/hybrid.yaml": str(REPO / "configs" / "hybrid.yaml"),
        "--trainer.callbacks.every_n_train_steps=50": "--trainer.callbacks.every_n_train_steps=4",
    }
    assert set(scale) <= set(command), command
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(scale.get(word, word) for word in command),
        f"--trainer.callbacks.dirpath={ckpt}",  # the ModelCheckpoint the command adds: where the first run saved
        *common(corpus, root / "cache", steps=FAULT_STEPS),
        f"--trainer.logger.init_args.save_dir={root / 'relaunch'}",
        "--trainer.logger.init_args.flush_logs_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.strategy.timeout=30",
        *FSDP2,
        callback("models.CrashOnce", step=10, marker=str(crashed)),
    ]
    relaunch = run(cmd, root, timeout=600, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    return KilledThenRestarted(
        ended_after, left_running, returncode, job.stderr(), relaunch, crashed, root / "relaunch" / "hybrid"
    )


def test_a_killed_rank_ends_every_rank_at_once_and_the_relaunch_continues_from_last(
    straight_fsdp2, killed_then_restarted
):
    """Rank 1 is SIGKILLed at step 7 under the default timeout: every rank is gone within seconds (not by a timeout),
    and the relaunch with `--ckpt_path=last` continues from the step-5 checkpoint with the uninterrupted run's
    losses (the relaunch of `killed_then_restarted`: its first attempt, before its own crash at step 10)."""
    straight = straight_fsdp2
    job = killed_then_restarted
    assert job.left_running == [], f"ranks still running {job.ended_after:.1f} s after the kill: {job.left_running}"
    assert job.returncode not in (None, 0), job.stderr[-3000:]
    print(f"every rank ended {job.ended_after:.1f} s after rank 1 was killed")
    resumed = step_losses(job.logs / "version_0")
    assert sorted(resumed) == [5, 6, 7, 8, 9]  # from the step-5 checkpoint, not from scratch
    assert_same_losses({s: straight[s] for s in resumed}, resumed, rtol=1e-6)


def test_a_kill_between_checkpointing_a_step_and_logging_it_loses_no_logged_step(tmp_path, corpus, straight_fsdp2):
    """Every rank dies at the end of step 6's on_train_batch_end hooks, where ModelCheckpoint (save_top_k=1,
    save_last) saved step 6 and last.ckpt and removed step 3's checkpoint, before Lightning logs that step (it does
    after those hooks). Neither save was published, and the removal waited for them: step 3's checkpoint and `last`
    (step 3's) are there, and the first run's log and the relaunch's together hold every step, with the uninterrupted
    run's losses. The relaunch publishes each checkpoint once its step is logged and leaves no staging behind."""
    ckpt = tmp_path / "ckpt"
    keep_one = (
        '--trainer.callbacks+={"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": '
        f'{{"dirpath": "{ckpt}", "every_n_train_steps": 3, "save_last": true}}}}'
    )
    common_args = (*common(corpus, tmp_path / "cache", steps=ROOM), *FSDP2, keep_one)
    proc = fit("hybrid.yaml", tmp_path / "first", *common_args, callback("models.DieBeforeLogging", step=6))
    assert proc.returncode != 0
    first = step_losses(tmp_path / "first")
    assert sorted(first) == [0, 1, 2, 3, 4], "the kill came after step 5 was logged"
    left = ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt.partial", "last.ckpt", "last.ckpt.partial"]
    assert sorted(p.name for p in ckpt.iterdir()) == left
    assert_ok(fit("hybrid.yaml", tmp_path / "resumed", *common_args, "--ckpt_path=last"))
    resumed = step_losses(tmp_path / "resumed")
    assert min(resumed) == 3 and set(first) | set(resumed) == set(range(ROOM))
    assert_same_losses({s: straight_fsdp2[s] for s in first}, first, rtol=1e-6)
    assert_same_losses({s: straight_fsdp2[s] for s in resumed}, resumed, rtol=1e-6)
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=9.ckpt", "last.ckpt"]


def test_sigterm_at_a_checkpointing_step_publishes_that_steps_checkpoint(tmp_path, corpus):
    """One process under a parallelkit strategy, SIGTERMed in the step that ModelCheckpoint saves at step 6:
    Lightning raises SIGTERMException once that step is logged, before another batch starts, and
    PreemptionCheckpoint saves last.ckpt. Step 6's checkpoint is published beside it, not left under its staging
    name waiting for a next batch."""
    ckpt = tmp_path / "ckpt"
    one = ["--trainer.devices=1", '--trainer.strategy.mesh_shape=[[1, 1], ["fsdp", "tp"]]']
    overrides = (*one, checkpoint_every(ckpt, 3), callback("models.SigtermAt", step=6))
    assert_ok(fit("hybrid.yaml", tmp_path, *common(corpus, tmp_path / "cache", steps=ROOM), *overrides))
    assert max(step_losses(tmp_path)) == 5
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]


def test_sigterm_saves_last_and_exits_cleanly_and_the_relaunch_loses_nothing(tmp_path, corpus, straight_fsdp2):
    """SIGTERM to every process of a sharded [[2, 1]] job (what SLURM or torchrun does): the ranks agree on a step,
    save last.ckpt, exit 0, and the relaunch continues with the uninterrupted run's losses."""
    straight = straight_fsdp2
    ckpt = tmp_path / "ckpt"
    with training_in_background(
        tmp_path, corpus, tmp_path / "first", *FSDP2, checkpoint_every(ckpt, 4), until=ckpt / "epoch=0-step=4.ckpt"
    ) as job:
        os.killpg(job.pid, signal.SIGTERM)  # what SLURM or torchrun does to every process of the job
        job.wait(timeout=120)
    assert job.returncode == 0, job.stderr()[-3000:]
    assert (ckpt / "last.ckpt" / "meta.pt").is_file()
    stopped_at = max(step_losses(tmp_path / "first"))
    assert stopped_at < ROOM - 1
    resume = [*FSDP2, "--ckpt_path=last", checkpoint_every(ckpt, 4)]
    assert_ok(fit("hybrid.yaml", tmp_path / "resumed", *common(corpus, tmp_path / "cache", steps=ROOM), *resume))
    resumed = step_losses(tmp_path / "resumed")
    assert min(resumed) == stopped_at + 1  # the step after the last one trained: nothing lost, nothing repeated
    assert_same_losses({s: straight[s] for s in resumed}, resumed, rtol=1e-6)


def test_ctrl_c_says_what_was_saved_and_its_resume_command_continues_exactly(tmp_path, corpus, straight_fsdp2):
    """Ctrl-C on [[2, 1]] (SIGINT to every process of the job, as a terminal sends it): the ranks agree on a step, save
    it as `last.ckpt` (the step being trained: nothing lost) and exit 130, with no traceback and no C++ warning about
    collectives left in flight; rank 0 says once what was saved and the command that resumes from it. That command,
    run as printed, continues with the uninterrupted run's losses in the same run's directories: its ModelCheckpoint,
    given no dirpath, saves under the logger's version directory, where the resume logs on (one version directory, no
    "dirpath has changed" warning, the CSV holding every step once, in order)."""
    logs = tmp_path / "first"
    ckpt = logs / "hybrid" / "version_0" / "checkpoints"
    save = callback("lightning.pytorch.callbacks.ModelCheckpoint", every_n_train_steps=4, save_last=True)
    with training_in_background(tmp_path, corpus, logs, *FSDP2, save, until=ckpt / "epoch=0-step=4.ckpt") as job:
        os.killpg(job.pid, signal.SIGINT)
        job.wait(timeout=120)
    stderr = job.stderr()
    assert job.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "unwaited" not in stderr, stderr[-3000:]
    (said,) = [line for line in stderr.splitlines() if line.startswith("Interrupted at step ")]
    stopped_at = max(step_losses(logs))  # the last step logged
    assert stopped_at < ROOM - 1
    assert said.startswith(f"Interrupted at step {stopped_at + 1}, which is saved: {ckpt / 'last.ckpt'};"), said
    assert torch.load(ckpt / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == stopped_at + 1
    command = shlex.split(said.partition("resume from it with: ")[2])
    assert command[0] == "parallelkit" and command[-1] == "--ckpt_path=last"
    proc = parallelkit(*command[1:], cwd=tmp_path)
    assert_ok(proc)
    assert "not resumable" not in proc.stderr  # Lightning's warning for a loader it cannot resume mid-epoch
    assert "dirpath has changed" not in proc.stderr and "exists and is not empty" not in proc.stderr, proc.stderr
    assert [p.name for p in (logs / "hybrid").iterdir()] == ["version_0"]
    with open(logs / "hybrid" / "version_0" / "metrics.csv", newline="") as file:
        logged = [int(row["step"]) for row in csv.DictReader(file) if row["train_loss"]]
    assert logged == list(range(ROOM))  # the saving run's steps, then the resumed run's from the next one
    assert_same_losses({s: straight_fsdp2[s] for s in logged}, step_losses(logs), rtol=1e-6)


def test_a_second_ctrl_c_quits_at_once_without_saving(tmp_path, corpus):
    """Ctrl-C twice on [[2, 1]] while rank 1 is stuck (`models.HangAt`: asleep as step 5 starts, rank 0 waiting for it
    in a collective, where Python never sees a signal): the first only asks for the step to be saved at its end,
    which never comes; the second ends every process at once with 130, without a traceback. Nothing more is saved:
    `last.ckpt` is still step 4's."""
    ckpt = tmp_path / "ckpt"
    hang = callback("models.HangAt", rank=1, step=5)
    with training_in_background(
        tmp_path,
        corpus,
        tmp_path / "first",
        *FSDP2,
        checkpoint_every(ckpt, 4, last=True),
        hang,
        until=ckpt / "epoch=0-step=4.ckpt",
    ) as job:
        os.killpg(job.pid, signal.SIGINT)
        time.sleep(2.0)  # a second press, not the same one delivered twice (a terminal's and torchrun's)
        os.killpg(job.pid, signal.SIGINT)
        job.wait(timeout=60)
    stderr = job.stderr()
    assert job.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "unwaited" not in stderr, stderr[-3000:]
    assert [line for line in stderr.splitlines() if line.startswith("parallelkit: Ctrl-C again:")] == [
        "parallelkit: Ctrl-C again: quit without saving the step being trained (a checkpoint being written stays "
        "`.partial`, which is never read)."
    ]
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert torch.load(ckpt / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 4


def test_an_interrupt_before_the_fit_attached_the_model_passes_through_the_strategys_exception_hook():
    """Ctrl-C can reach rank 0 while Lightning's launcher is still starting the other ranks, before the fit has
    attached the model to the trainer; Lightning then hands the interrupt to the strategy's exception hook. Seen once
    in the suite: the hook asked the unattached model for its trainer, and a RuntimeError replaced the one-line exit
    130 with a traceback. The hook now lets the interrupt through untouched."""
    from parallelkit import FSDPTPStrategy
    from parallelkit.callbacks.preemption import Interrupted

    strategy = FSDPTPStrategy(mesh_shape=[[1], ["fsdp"]])
    strategy.connect(GPT(n_layer=1, n_head=2, n_embd=16))
    strategy.on_exception(Interrupted(130))  # raised "GPT is not attached to a `Trainer`" before


def test_ctrl_c_while_the_ranks_start_ends_the_job_with_one_line(tmp_path, corpus):
    """Ctrl-C (SIGINT to every process of a [[2, 1]] job) as Lightning's launcher has just started rank 1: rank 0 waits
    for it in the process group's rendezvous (in C++, where Python never sees a signal), rank 1 is still reading its
    command line. The job ends with 130 and one line from rank 0, saying nothing was trained or saved: no traceback
    (there was one per rank, and an exit 137), no log of a step, no checkpoint."""
    logs = tmp_path / "first"
    args = [
        "fit",
        "--config",
        str(REPO / "configs" / "hybrid.yaml"),
        *common(corpus, tmp_path / "cache"),
        f"--trainer.logger.init_args.save_dir={logs}",
        "--trainer.enable_progress_bar=false",
        *FSDP2,
    ]
    job = launch(args, cwd=tmp_path)
    try:
        deadline = time.time() + slack(120)
        while len(job.ranks()) < 2:
            assert job.poll() is None and time.time() < deadline, job.stderr()[-3000:]
            time.sleep(0.01)
        time.sleep(0.1)  # rank 1 past its first instructions (a fresh interpreter's own start would print a traceback)
        os.killpg(job.pid, signal.SIGINT)
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    stderr = job.stderr()
    assert job.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    said = [line for line in stderr.splitlines() if "nterrupt" in line]
    assert said == ["parallelkit: interrupted before training started: nothing was trained or saved."], stderr
    assert not list(logs.rglob("metrics.csv")) and not list(logs.rglob("*.ckpt"))


def test_ctrl_c_in_the_first_seconds_of_the_real_command_ends_it_with_one_line(tmp_path, corpus):
    """`parallelkit fit --config configs/hybrid.yaml` itself (its console script: start-up is what is under test),
    SIGINT to its process group at moments of its start-up (Python starting, torch and Lightning loading, the ranks
    starting), from a script's background job, whose parent ignores SIGINT (the job inherits that: Ctrl-C in its
    first seconds went unheard and the job trained on), and from a terminal. Each ends with 130 and rank 0's line,
    nothing left running."""
    args = ["parallelkit", "fit", "--config", str(REPO / "configs" / "hybrid.yaml"), *common(corpus, tmp_path / "c")]
    for moment, parent_ignores in ((0.5, True), (1.5, False), (3.0, True)):
        job = subprocess.Popen(
            [*args, f"--trainer.logger.init_args.save_dir={tmp_path / str(moment)}"],
            cwd=tmp_path,
            env=subprocess_env(),
            start_new_session=True,
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if parent_ignores else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(moment)
            os.killpg(job.pid, signal.SIGINT)
            _, stderr = job.communicate(timeout=slack(120))
        finally:
            kill_session(job.pid)
        assert job.returncode == 130, (moment, stderr[-3000:])
        said = [line for line in stderr.splitlines() if "nterrupt" in line]
        assert said == ["parallelkit: interrupted before training started: nothing was trained or saved."], stderr
        assert not session(job.pid), moment


def test_the_progress_bar_of_a_resumed_run_counts_to_the_end_of_its_epoch():
    """The bar counts the batch index in the epoch, which a run resumed mid-epoch continues: its total is the epoch's
    batches up to `max_steps`, from the epoch's first batch. Lightning's counted the steps left from where the run
    started (a run resumed at step 51 of 200 showed 200/149), and steps as batches under gradient accumulation."""
    from types import SimpleNamespace

    from parallelkit.callbacks.display import ProgressBar

    def total(batches: int, max_steps: int, step: int, done: int, accumulate: int = 1) -> int:
        bar = ProgressBar()
        progress = SimpleNamespace(current=SimpleNamespace(processed=done))
        bar._trainer = SimpleNamespace(  # what the bar reads of a fit bounded by max_steps (max_epochs=-1)
            num_training_batches=batches,
            max_epochs=-1,
            max_steps=max_steps,
            global_step=step,
            accumulate_grad_batches=accumulate,
            fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
        )
        return bar.total_train_batches

    assert total(batches=300, max_steps=200, step=0, done=0) == 200  # a fresh run
    assert total(batches=300, max_steps=200, step=52, done=52) == 200  # resumed at step 51, its first batch done
    assert total(batches=150, max_steps=200, step=52, done=52) == 150  # the epoch ends first
    assert total(batches=300, max_steps=200, step=160, done=10) == 50  # a later epoch, begun at step 150
    assert total(batches=500, max_steps=100, step=51, done=103, accumulate=2) == 200  # half-way through a step


def test_sigterm_under_ddp_comm_saves_last_exits_cleanly_and_the_relaunch_loses_nothing(tmp_path, corpus, straight_one):
    """parallelkit's DDPStrategy (Lightning's DDP with a comm hook) preempted as the sharded strategies are: rank 0
    writes last.ckpt as a single file, every process exits 0, and the relaunch continues with one process's losses
    (fp32 being ddp_comm's default hook). Only rank 1 is signalled: the ranks must agree on the step to stop at (a
    rank that stops alone hangs the job, which is what a signal reaching rank 0 a moment after rank 1 did)."""
    ddp_comm = "--trainer.strategy=ddp_comm"
    ckpt = tmp_path / "ckpt"
    with training_in_background(
        tmp_path,
        corpus,
        tmp_path / "first",
        ddp_comm,
        checkpoint_every(ckpt, 2),
        until=ckpt / "epoch=0-step=2.ckpt",
        config="ddp.yaml",
    ) as job:
        os.kill(job.ranks()[1], signal.SIGTERM)
        job.wait(timeout=120)
    assert job.returncode == 0, job.stderr()[-3000:]
    assert (ckpt / "last.ckpt").is_file()
    stopped_at = max(step_losses(tmp_path / "first"))
    assert stopped_at < ROOM - 1
    resume = [ddp_comm, "--ckpt_path=last", checkpoint_every(ckpt, ROOM)]
    assert_ok(fit("ddp.yaml", tmp_path / "resumed", *common(corpus, tmp_path / "cache", steps=ROOM), *resume))
    resumed = step_losses(tmp_path / "resumed")
    assert min(resumed) == stopped_at + 1
    assert_same_losses({s: straight_one[s] for s in resumed}, resumed)


TP2 = ["--trainer.devices=2", '--trainer.strategy.mesh_shape=[[1, 2], ["fsdp", "tp"]]', "--data.init_args.batch_size=8"]
"""hybrid.yaml on [[1, 2]]: 2 processes sharing one batch of 8 (the global batch)."""


@pytest.mark.parametrize(
    ("config", "layout"),
    [
        ("1f1b.yaml", []),  # 1F1B, pp=2: each rank holds one stage, so last.ckpt needs both ranks' shards
        ("hybrid.yaml", TP2),  # a tp axis: every parameter split over both ranks
    ],
    ids=["1f1b_pp2", "tp2"],
)
def test_sigterm_to_one_rank_of_a_pipeline_or_tp_job_saves_last_and_the_relaunch_loses_nothing(
    tmp_path, corpus, straight_one, config, layout
):
    """Every strategy is preempted alike (the README's claim): a 1F1B pp=2 job and a [[1, 2]] fsdp x tp job, SIGTERM
    to rank 1 only (the launcher is rank 0): the ranks agree on the step, save a complete sharded last.ckpt (its
    metadata, one shard file per rank, nothing left staged), exit 0, and the relaunch continues with one process's
    losses, a few steps being enough to tell."""
    ckpt = tmp_path / "ckpt"
    with training_in_background(
        tmp_path,
        corpus,
        tmp_path / "first",
        *layout,
        checkpoint_every(ckpt, 2),
        until=ckpt / "epoch=0-step=2.ckpt",
        config=config,
    ) as job:
        os.kill(job.ranks()[1], signal.SIGTERM)
        job.wait(timeout=120)
    assert job.returncode == 0, job.stderr()[-3000:]
    last = ckpt / "last.ckpt"
    assert (last / "meta.pt").is_file() and (last / ".metadata").is_file(), sorted(p.name for p in last.iterdir())
    assert len(list(last.glob("*.distcp"))) == 2 and not list(ckpt.glob("*.partial"))
    stopped_at = max(step_losses(tmp_path / "first"))
    assert stopped_at < ROOM - 3
    stop = callback("models.StopAfter", step=stopped_at + 3)
    resume = [*layout, "--ckpt_path=last", checkpoint_every(ckpt, ROOM), stop]
    assert_ok(fit(config, tmp_path / "resumed", *common(corpus, tmp_path / "cache", steps=ROOM), *resume))
    resumed = step_losses(tmp_path / "resumed")
    assert sorted(resumed) == [stopped_at + 1, stopped_at + 2]  # nothing lost, nothing repeated
    assert_same_losses({s: straight_one[s] for s in resumed}, resumed)


ASYNC = "--trainer.strategy.async_checkpoint=true"


@pytest.mark.parametrize("writes", ["sync", "async"])
def test_sigkill_in_the_middle_of_a_save_leaves_the_previous_checkpoint_for_last(
    tmp_path, corpus, straight_fsdp2, writes
):
    """Rank 1 of a sharded [[2, 1]] job is SIGKILLed while the step-8 checkpoint is being written (in the save, or
    `async_checkpoint`: in the background while training goes on): the job fails, the half-written save stays under
    its staging name, and `--ckpt_path=last` resumes from step 4 exactly as the uninterrupted run."""
    straight = straight_fsdp2
    ckpt = tmp_path / "ckpt"
    run = [
        *common(corpus, tmp_path / "cache", steps=ROOM),
        *FSDP2,
        "--trainer.strategy.timeout=30",
        *FSDP2,
        checkpoint_every(ckpt, 4, last=True),
        *([ASYNC] if writes == "async" else []),
    ]
    killer = '--trainer.callbacks+={"class_path": "models.KillDuringSave", "init_args": {"step": 8}}'
    killed = fit("hybrid.yaml", tmp_path / "killed", *run, killer, timeout=300)
    assert killed.returncode != 0
    (partial,) = ckpt.glob("*.partial")
    assert partial.name == "epoch=0-step=8.ckpt.partial" and any(partial.glob("*.distcp"))
    assert not (ckpt / "epoch=0-step=8.ckpt").exists()
    assert_ok(fit("hybrid.yaml", tmp_path / "resumed", *run, "--ckpt_path=last"))
    resumed = step_losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(4, ROOM))
    assert_same_losses({s: straight[s] for s in resumed}, resumed, rtol=1e-6)


def test_sigterm_with_a_background_write_in_flight_waits_for_it_and_its_checkpoint_resumes_exactly(
    tmp_path, corpus, straight_fsdp2
):
    """`async_checkpoint` on [[2, 1]], a checkpoint every 4 steps whose step-8 write takes 4 s longer (a slow file
    system), SIGTERM as step 9 starts: training went on past the save (the step after it was logged before the write
    ended), the SIGTERM save waited for the write and published it before its own, every process exits 0 with
    nothing left staged, and the background-written step-8 checkpoint resumes with the uninterrupted run's losses."""
    ckpt = tmp_path / "ckpt"
    run = [*common(corpus, tmp_path / "cache", steps=FAULT_STEPS), *FSDP2, ASYNC, checkpoint_every(ckpt, 4)]
    written, signalled = tmp_path / "written", tmp_path / "signalled"
    slow = callback("models.SlowWrite", step=8, seconds=4, marker=str(written))
    sigterm = callback("models.SigtermAt", step=9, marker=str(signalled))
    assert_ok(fit("hybrid.yaml", tmp_path / "first", *run, slow, sigterm))
    assert written.stat().st_mtime > signalled.stat().st_mtime  # step 9 began while step 8's write went on
    assert 9 <= max(step_losses(tmp_path / "first")) < FAULT_STEPS - 1
    names = ["epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"]
    assert sorted(p.name for p in ckpt.iterdir()) == names  # published, none left `.partial`
    assert_ok(fit("hybrid.yaml", tmp_path / "resumed", *run, f"--ckpt_path={ckpt / 'epoch=0-step=8.ckpt'}"))
    resumed = step_losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(8, FAULT_STEPS))
    assert_same_losses({s: straight_fsdp2[s] for s in resumed}, resumed, rtol=1e-6)


def test_torchrun_max_restarts_relaunches_a_crashed_job_from_the_last_checkpoint(straight_fsdp2, killed_then_restarted):
    """Rank 1 dies at step 10; torchrun restarts both workers, which resume from the step-8 checkpoint and finish
    with the uninterrupted run's losses. Launched as the checkpoints guide says (see `killed_then_restarted`: this is
    its relaunch, whose first attempt resumed the killed-rank job's step-5 checkpoint)."""
    straight = straight_fsdp2
    job = killed_then_restarted
    assert_ok(job.relaunch)
    assert job.crashed.exists()  # the fault did happen
    resumed = step_losses(job.logs / "version_1")  # the restarted attempt's log
    assert sorted(resumed) == list(range(8, FAULT_STEPS))
    assert_same_losses({s: straight[s] for s in resumed}, resumed, rtol=1e-6)


def test_a_single_file_checkpoint_round_trips_and_loads_in_another_layout(tmp_path, corpus, saved):
    """`save_distributed_checkpoint: false`: rank 0 writes one plain file, which torch.load(weights_only=True) and
    the unparallelised model read, and which resumes under [[2, 2]], 1f1b pp=2 and one plain Lightning process
    (configs/single.yaml: Lightning's own single-device strategy) with the straight run's losses."""
    straight, _ = saved
    ckpt = tmp_path / "ckpt"
    single_file = "--trainer.strategy.save_distributed_checkpoint=false"
    stop = callback("models.StopAfter", step=RESUME_AT)
    assert_ok(
        fit(
            "hybrid.yaml",
            tmp_path / "first",
            *common(corpus, tmp_path / "cache"),
            single_file,
            stop,
            checkpoint_every(ckpt, RESUME_AT),
        )
    )
    path = ckpt / f"epoch=0-step={RESUME_AT}.ckpt"
    assert path.is_file() and not list(ckpt.glob("*.partial"))
    state = torch.load(path, weights_only=True)
    GPT(n_layer=2, n_head=4, n_embd=64).load_state_dict(state["state_dict"])
    # The same layout; pipeline stages, which hold different parameters on different ranks; and one process with no
    # parallelkit strategy, which reads the file with Lightning's own loader (optimizer state indexed in model order).
    for name, config in (("same", "hybrid.yaml"), ("pp2", "1f1b.yaml"), ("one_process", "single.yaml")):
        assert_ok(fit(config, tmp_path / name, *common(corpus, tmp_path / "cache"), f"--ckpt_path={path}"))
        resumed = step_losses(tmp_path / name)
        assert sorted(resumed) == list(range(RESUME_AT, STEPS))
        assert_same_losses({s: straight[s] for s in resumed}, resumed, rtol=1e-6 if name == "same" else 1e-5)


def test_2x2_resume_mid_epoch_continues_exactly(saved, resumed_2x2):
    """The shared [[2, 2]] run resumed from its step-`RESUME_AT` checkpoint (the run `resumed_2x2` makes: the
    checkpoint is found as `last`) gives the uninterrupted run's steps from there."""
    losses, _ = saved
    resumed = resumed_2x2
    assert sorted(resumed) == list(range(RESUME_AT, STEPS))
    assert_same_losses({s: losses[s] for s in resumed}, resumed, rtol=1e-6)


@pytest.mark.parametrize("config", ["1f1b.yaml", "single.yaml"])
def test_resume_mid_epoch_continues_exactly(tmp_path, corpus, reference, config):
    """A run checkpointed half-way (step `RESUME_AT` of `STEPS`), then the same run resumed from that checkpoint: one
    process is Lightning's own strategy with parallelkit's data position."""
    run = reference(config)
    assert_ok(fit(config, tmp_path, *common(corpus, tmp_path / "cache"), f"--ckpt_path={run.checkpoint}"))
    resumed, straight = step_losses(tmp_path), run.losses()
    assert sorted(resumed) == list(range(RESUME_AT, STEPS))
    assert_same_losses({s: straight[s] for s in resumed}, resumed, rtol=1e-6)


def test_pipeline_refuses_a_single_file_checkpoint_that_would_hold_one_stage(tmp_path):
    proc = fit("1f1b.yaml", tmp_path, "--trainer.strategy.save_distributed_checkpoint=false")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "holds only the first pipeline stage" in proc.stderr and "parallelkit consolidate" in proc.stderr


def test_async_checkpoint_refuses_a_single_file_checkpoint():
    from parallelkit import FSDPTPStrategy
    from parallelkit.errors import ConfigError

    with pytest.raises(ConfigError, match="async_checkpoint=True writes each rank's shards in the background"):
        FSDPTPStrategy(async_checkpoint=True, save_distributed_checkpoint=False).check_options()
