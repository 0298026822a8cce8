"""Checkpoints: load across layouts, consolidate to one file, refuse what does not fit, survive crashes."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    assert_ok,
    assert_same_losses,
    checkpoint_every,
    common,
    fit,
    free_port,
    parallelkit,
    run,
    step_losses,
    subprocess_env,
)

from parallelkit.models import GPT

STEPS = 20


@pytest.fixture(scope="module")
def saved(reference):
    """A [[2, 2]] run of 20 steps that checkpoints at step 10: (its losses, the step-10 checkpoint)."""
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
            "--trainer.max_steps=12",
            f"--ckpt_path={ckpt}",
            *layout,
        )
    )
    assert_same_losses({10: losses[10], 11: losses[11]}, step_losses(tmp_path))


def test_consolidated_weights_load_into_the_plain_model(tmp_path, saved):
    _, ckpt = saved
    out = tmp_path / "weights.pt"
    assert_ok(parallelkit("consolidate", str(ckpt), str(out), cwd=tmp_path))
    weights = torch.load(out, weights_only=True)
    model = GPT(n_layer=2, n_head=4, n_embd=64)
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(weights)  # strict: every name and shape matches the unparallelised model
    assert any(not torch.equal(fresh[k], weights[k]) for k in weights)  # trained weights, not an init


def test_checkpoint_of_another_model_shape_names_the_mismatched_parameters(tmp_path, corpus, saved):
    _, ckpt = saved
    proc = fit(
        "hybrid.yaml",
        tmp_path,
        *common(corpus, tmp_path / "cache"),
        f"--ckpt_path={ckpt}",
        "--model.init_args.n_embd=32",
    )
    assert proc.returncode != 0
    assert "does not fit GPT: tok_emb.weight is (256, 64) in the checkpoint but (256, 32) in the model" in proc.stderr


def test_sharded_checkpoint_with_a_single_device_strategy_says_how_to_load_it(tmp_path, corpus, saved):
    _, ckpt = saved
    proc = fit("single.yaml", tmp_path, *common(corpus, tmp_path / "cache"), f"--ckpt_path={ckpt}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "is a sharded checkpoint" in proc.stderr and "parallelkit consolidate" in proc.stderr


def test_a_save_cut_short_is_ignored_and_last_resumes_from_the_complete_one(tmp_path, corpus):
    ckpt = tmp_path / "ckpt"
    assert_ok(
        fit(
            "hybrid.yaml",
            tmp_path / "first",
            *common(corpus, tmp_path / "cache"),
            "--trainer.max_steps=10",
            checkpoint_every(ckpt, 5, last=True),
        )
    )
    assert (ckpt / "last.ckpt" / "meta.pt").is_file() and not list(ckpt.glob("*.partial"))
    # What a process killed mid-save leaves behind: shards under the staging name, newer than last.ckpt.
    partial = ckpt / "last.ckpt.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"truncated")
    assert_ok(
        fit(
            "hybrid.yaml",
            tmp_path / "resumed",
            *common(corpus, tmp_path / "cache"),
            "--trainer.max_steps=12",
            checkpoint_every(ckpt, 5, last=True),
            "--ckpt_path=last",
        )
    )
    assert sorted(step_losses(tmp_path / "resumed")) == [10, 11]


@contextlib.contextmanager
def training_in_background(tmp_path, corpus, save_dir, *overrides: str, until: Path, config: str = "hybrid.yaml"):
    """A run of configs/<config> (4-process hybrid by default) in its own session, yielded once `until` exists;
    killed whole if left running."""
    args = [
        sys.executable,
        "-m",
        "parallelkit.cli",
        "fit",
        "--config",
        str(REPO / "configs" / config),
        *common(corpus, tmp_path / "cache"),
        f"--trainer.logger.init_args.save_dir={save_dir}",
        "--trainer.enable_progress_bar=false",
        *overrides,
    ]
    job = subprocess.Popen(
        args,
        cwd=tmp_path,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        while not until.exists():
            assert job.poll() is None and time.time() < deadline, f"training never produced {until}"
            time.sleep(0.2)
        yield job
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def test_killing_one_rank_ends_every_rank_and_a_relaunch_resumes(tmp_path, corpus):
    ckpt = tmp_path / "ckpt"
    overrides = ["--trainer.max_steps=100000", "--trainer.strategy.timeout=30", checkpoint_every(ckpt, 5, last=True)]
    with training_in_background(tmp_path, corpus, tmp_path, *overrides, until=ckpt / "last.ckpt") as main:
        ranks = subprocess.run(["pgrep", "-P", str(main.pid)], capture_output=True, text=True).stdout.split()
        assert len(ranks) == 3  # ranks 1..3, launched by rank 0
        os.kill(int(ranks[1]), signal.SIGKILL)
        killed_at = time.time()
        main.wait(timeout=30 + 30)
        assert main.returncode != 0

        def survivors() -> list[str]:
            return subprocess.run(["pgrep", "-s", str(main.pid)], capture_output=True, text=True).stdout.split()

        # Within the collective timeout (30 s) + 30 s, every rank is gone.
        while survivors() and time.time() - killed_at < 60:
            time.sleep(0.5)
        assert survivors() == [], f"ranks still running 60 s after the kill: {survivors()}"
    relaunch = fit(
        "hybrid.yaml",
        tmp_path / "relaunch",
        *common(corpus, tmp_path / "cache"),
        "--ckpt_path=last",
        checkpoint_every(ckpt, 5, last=True),
        "--trainer.max_steps=1",
    )
    # max_steps=1 is already reached by the checkpoint: the relaunch loads it and stops at once.
    assert_ok(relaunch)


def test_sigterm_saves_last_and_exits_cleanly_and_the_relaunch_loses_nothing(tmp_path, corpus, saved):
    straight, _ = saved
    ckpt = tmp_path / "ckpt"
    with training_in_background(
        tmp_path, corpus, tmp_path / "first", checkpoint_every(ckpt, 4), until=ckpt / "epoch=0-step=4.ckpt"
    ) as job:
        os.killpg(job.pid, signal.SIGTERM)  # what SLURM or torchrun does to every process of the job
        _, stderr = job.communicate(timeout=120)
    assert job.returncode == 0, stderr[-3000:]
    assert (ckpt / "last.ckpt" / "meta.pt").is_file()
    stopped_at = max(step_losses(tmp_path / "first"))
    assert stopped_at < STEPS - 1
    resume = ["--ckpt_path=last", checkpoint_every(ckpt, 4)]
    assert_ok(fit("hybrid.yaml", tmp_path / "resumed", *common(corpus, tmp_path / "cache"), *resume))
    resumed = step_losses(tmp_path / "resumed")
    assert min(resumed) == stopped_at + 1  # the step after the last one trained: nothing lost, nothing repeated
    assert_same_losses({s: straight[s] for s in resumed}, resumed, rtol=1e-6)


def test_sigterm_under_ddp_comm_saves_last_exits_cleanly_and_the_relaunch_loses_nothing(tmp_path, corpus, reference):
    """parallelkit's DDPStrategy (Lightning's DDP with a comm hook) preempted as the sharded strategies are: rank 0
    writes last.ckpt as a single file, every process exits 0, and the relaunch continues the uninterrupted run."""
    ddp_comm = "--trainer.strategy=ddp_comm"
    straight = reference("ddp.yaml", ddp_comm).losses()
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
        os.killpg(job.pid, signal.SIGTERM)
        _, stderr = job.communicate(timeout=120)
    assert job.returncode == 0, stderr[-3000:]
    assert (ckpt / "last.ckpt").is_file()
    stopped_at = max(step_losses(tmp_path / "first"))
    assert stopped_at < STEPS - 1
    resume = [ddp_comm, "--ckpt_path=last", checkpoint_every(ckpt, STEPS)]
    assert_ok(fit("ddp.yaml", tmp_path / "resumed", *common(corpus, tmp_path / "cache"), *resume))
    resumed = step_losses(tmp_path / "resumed")
    assert min(resumed) == stopped_at + 1
    assert_same_losses({s: straight[s] for s in resumed}, resumed, rtol=1e-6)


def test_sigkill_in_the_middle_of_a_save_leaves_the_previous_checkpoint_for_last(tmp_path, corpus, saved):
    """Rank 1 is SIGKILLed while the step-8 checkpoint is being written: the job fails, the half-written save stays
    under its staging name, and `--ckpt_path=last` resumes from step 4 exactly as the uninterrupted run."""
    straight, _ = saved
    ckpt = tmp_path / "ckpt"
    run = [*common(corpus, tmp_path / "cache"), "--trainer.strategy.timeout=30", checkpoint_every(ckpt, 4, last=True)]
    killer = '--trainer.callbacks+={"class_path": "models.KillDuringSave", "init_args": {"step": 8}}'
    killed = fit("hybrid.yaml", tmp_path / "killed", *run, killer, timeout=300)
    assert killed.returncode != 0
    (partial,) = ckpt.glob("*.partial")
    assert partial.name == "epoch=0-step=8.ckpt.partial" and any(partial.glob("*.distcp"))
    assert not (ckpt / "epoch=0-step=8.ckpt").exists()
    assert_ok(fit("hybrid.yaml", tmp_path / "resumed", *run, "--ckpt_path=last"))
    resumed = step_losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(4, STEPS))
    assert_same_losses({s: straight[s] for s in resumed}, resumed, rtol=1e-6)


def test_torchrun_max_restarts_relaunches_a_crashed_job_from_the_last_checkpoint(tmp_path, corpus, saved):
    """Rank 1 dies at step 10; torchrun restarts all 4 workers, which resume from the step-8 checkpoint and finish
    with the uninterrupted run's losses. Launched as the README says: c10d rendezvous, and the rendezvous store not
    shared with the process group (torch 2.13 with gloo otherwise hands a restarted worker the previous attempt's
    peer addresses: "Gloo connectFullMesh failed ... Connection refused"; pytorch/pytorch#135712)."""
    straight, _ = saved
    crash = (
        '--trainer.callbacks+={"class_path": "models.CrashOnce", "init_args": '
        f'{{"step": 10, "marker": "{tmp_path / "crashed"}"}}}}'
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=4",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "-m",
        "parallelkit.cli",
        "fit",
        "--config",
        str(REPO / "configs" / "hybrid.yaml"),
        *common(corpus, tmp_path / "cache"),
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
        "--trainer.strategy.timeout=30",
        checkpoint_every(tmp_path / "ckpt", 4, last=True),
        crash,
        "--ckpt_path=last",
    ]
    assert_ok(run(cmd, tmp_path, timeout=600, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    assert (tmp_path / "crashed").exists()  # the fault did happen
    resumed = step_losses(tmp_path)  # the restarted attempt's log (the newest version)
    assert sorted(resumed) == list(range(8, STEPS))
    assert_same_losses({s: straight[s] for s in resumed}, resumed, rtol=1e-6)


def test_a_single_file_checkpoint_round_trips_and_loads_in_another_layout(tmp_path, corpus, saved):
    """`save_distributed_checkpoint: false`: rank 0 writes one plain file, which torch.load(weights_only=True) and
    the unparallelised model read, and which resumes under [[2, 2]] and 1f1b pp=2 with the straight run's losses."""
    straight, _ = saved
    ckpt = tmp_path / "ckpt"
    single_file = "--trainer.strategy.save_distributed_checkpoint=false"
    stop = '--trainer.callbacks+={"class_path": "models.StopAfter", "init_args": {"step": 10}}'
    assert_ok(
        fit(
            "hybrid.yaml",
            tmp_path / "first",
            *common(corpus, tmp_path / "cache"),
            single_file,
            stop,
            checkpoint_every(ckpt, 10),
        )
    )
    path = ckpt / "epoch=0-step=10.ckpt"
    assert path.is_file() and not list(ckpt.glob("*.partial"))
    state = torch.load(path, weights_only=True)
    GPT(n_layer=2, n_head=4, n_embd=64).load_state_dict(state["state_dict"])
    # The same layout; and pipeline stages, which hold different parameters on different ranks.
    for name, config in (("same", "hybrid.yaml"), ("pp2", "1f1b.yaml")):
        assert_ok(fit(config, tmp_path / name, *common(corpus, tmp_path / "cache"), f"--ckpt_path={path}"))
        resumed = step_losses(tmp_path / name)
        assert sorted(resumed) == list(range(10, STEPS))
        assert_same_losses({s: straight[s] for s in resumed}, resumed, rtol=1e-6 if name == "same" else 1e-5)


def test_2x2_resume_mid_epoch_continues_exactly(tmp_path, corpus, saved):
    losses, ckpt = saved
    assert_ok(fit("hybrid.yaml", tmp_path, *common(corpus, tmp_path / "cache"), f"--ckpt_path={ckpt}"))
    resumed = step_losses(tmp_path)
    assert sorted(resumed) == list(range(10, STEPS))
    assert_same_losses({s: losses[s] for s in resumed}, resumed, rtol=1e-6)


@pytest.mark.parametrize("config", ["1f1b.yaml", "single.yaml"])
def test_resume_mid_epoch_continues_exactly(tmp_path, corpus, reference, config):
    """A run checkpointed at step 10 of 20, then the same run resumed from that checkpoint: one process is
    Lightning's own strategy with parallelkit's data position."""
    run = reference(config)
    assert_ok(fit(config, tmp_path, *common(corpus, tmp_path / "cache"), f"--ckpt_path={run.checkpoint}"))
    resumed, straight = step_losses(tmp_path), run.losses()
    assert sorted(resumed) == list(range(10, STEPS))
    assert_same_losses({s: straight[s] for s in resumed}, resumed, rtol=1e-6)


def test_pipeline_refuses_a_single_file_checkpoint_that_would_hold_one_stage(tmp_path):
    proc = fit("1f1b.yaml", tmp_path, "--trainer.strategy.save_distributed_checkpoint=false")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "holds only the first pipeline stage" in proc.stderr and "parallelkit consolidate" in proc.stderr
