"""Replica groups (`replica_groups`, torchft): separately launched groups of processes that train as one
data-parallel job, each step's quorum formed by a lighthouse, gradients averaged across groups by torchft's manager."""

import contextlib
import json
import signal
import sys
import time

import pytest
from snippets import parallelkit_args
from support import (
    REPO,
    assert_same_losses,
    callback,
    common,
    free_port,
    in_repo,
    launch,
    parallelkit,
    step_losses,
)

from parallelkit.errors import ConfigError
from parallelkit.mesh import MeshSpec
from parallelkit.parallel.replica_groups import ReplicaGroups

GROUP_MESH = ('--trainer.strategy.mesh_shape=[[2], ["fsdp"]]', "--trainer.devices=2")


def group_args(corpus, log, group: int, lighthouse: str, *extra: str) -> list[str]:
    """The multi-node guide's group command (hybrid.yaml, [[2], ["fsdp"]] inside each group, 2 samples per process: a
    global batch of 2 x 2 x 2 = 8, one process's baseline) as group `group`, on the suite's corpus."""
    command = in_repo(parallelkit_args("replica-groups", 1, **{"http://HOST:29510": lighthouse}))
    assert "--trainer.strategy.replica_groups.group=0" in command
    command = [arg.replace("replica_groups.group=0", f"replica_groups.group={group}") for arg in command]
    return [
        *command,
        *common(corpus, log / "cache"),
        f"--trainer.logger.init_args.save_dir={log}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.strategy.replica_groups.hostname=127.0.0.1",  # this machine's name may not resolve everywhere
        "--trainer.strategy.replica_groups.timeout=30",
        callback("models.StateDigest", out_dir=str(log / "digest")),
        *extra,
    ]


@contextlib.contextmanager
def running_lighthouse(directory, *options: str):
    """`parallelkit lighthouse` (the multi-node guide's command, on a free port, with `options`) as a user starts it
    (forked: the command is under test, not the interpreter's start), yielding its address; ended by SIGTERM, which
    it must take cleanly."""
    command = parallelkit_args("replica-groups", 0)  # the guide's: lighthouse --port 29510 --min-groups 2
    assert command[:3] == ["lighthouse", "--port", "29510"]
    job = launch([*command[:2], str(free_port()), *command[3:], *options], cwd=directory)
    try:
        deadline = time.time() + 60
        while not (job.directory / "stdout").exists() or "lighthouse at " not in job.stdout():
            assert job.poll() is None and time.time() < deadline, job.stdout() + job.stderr()
            time.sleep(0.05)
        address = job.stdout().split()[2].rstrip(":")  # "lighthouse at http://HOST:PORT: start each group with ..."
        yield f"http://127.0.0.1:{address.rsplit(':', 1)[1]}"  # this machine's name may not resolve on every machine
    finally:
        job.kill(signal.SIGTERM)
    assert job.wait(timeout=30) == 0, job.stderr()


@pytest.fixture(scope="module")
def lighthouse(tmp_path_factory):
    """A lighthouse for 2 groups: no quorum forms until both have joined."""
    with running_lighthouse(tmp_path_factory.mktemp("lighthouse")) as address:
        yield address


def test_two_replica_groups_train_as_one_process_and_end_bit_identical(tmp_path, corpus, baseline, lighthouse):
    """2 groups x [[2], ["fsdp"]], each its own launch: every step has both groups in its quorum and commits; each
    group logs its own rows' loss, and their mean is one process's (fp32, 1e-5: each group's mean over its half of
    the global batch); both groups end with the same parameters and AdamW state, shard by shard."""
    jobs = [launch(group_args(corpus, tmp_path / f"group{g}", g, lighthouse), cwd=tmp_path) for g in (0, 1)]
    for job in jobs:
        job.wait(timeout=300)
    for job in jobs:
        assert job.returncode == 0, job.stderr()[-4000:]
    logs = [tmp_path / f"group{g}" for g in (0, 1)]
    losses = [step_losses(log) for log in logs]
    mean = {step: (losses[0][step] + losses[1][step]) / 2 for step in losses[0]}
    assert_same_losses(baseline("plain").losses(), mean)
    assert losses[0][0] != losses[1][0]  # each group trained other rows
    for log in logs:
        assert set(step_losses(log, "ft/participants").values()) == {2.0}
        assert list(step_losses(log, "ft/committed_steps").values()) == [float(s) for s in range(1, 21)]
    for rank in (0, 1):
        digests = [json.loads((log / "digest" / f"rank{rank}.json").read_text()) for log in logs]
        assert digests[0] == digests[1] and digests[0]["optimized"] > 0, digests


def test_what_replica_groups_cannot_take_is_refused_before_launch(tmp_path, monkeypatch):
    """A group index outside the job's, no lighthouse, one nothing answers at, a mesh with its own replicate axis,
    gradient accumulation (a retried step would need its earlier micro-batches), and torchft missing: each refused
    naming the field and the fix (the CLI, fit and check: one process, before any rank starts)."""
    mesh = MeshSpec.parse([[2], ["fsdp"]])
    with pytest.raises(ConfigError, match=r"replica_groups.group=2 with num_groups=2: .*Fix: launch group i of n"):
        ReplicaGroups(group=2, num_groups=2, lighthouse="http://h:1").check(mesh)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match=r"no lighthouse.*parallelkit lighthouse"):
        ReplicaGroups(group=0, num_groups=2).check(mesh)
    with pytest.raises(ConfigError, match=r"no replicate axis"):
        hsdp = MeshSpec.parse([[2, 2], ["replicate", "fsdp"]])
        ReplicaGroups(group=0, num_groups=2, lighthouse="http://h:1").check(hsdp)
    with pytest.raises(ConfigError, match=r"accumulate_grad_batches=2: a step that fails to commit is tried again"):
        ReplicaGroups(group=0, num_groups=2).check_accumulation(2)
    unreachable = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=r"nothing answers there within 2 s .*parallelkit lighthouse --port"):
        ReplicaGroups(group=0, num_groups=2, lighthouse=unreachable, timeout=2).check(mesh)
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ConfigError, match=r"needs torchft.*pip install 'parallelkit\[ft\]'"):
        ReplicaGroups(group=0, num_groups=2, lighthouse="http://h:1").check(mesh)
    proc = parallelkit(
        "fit",
        "--config",
        str(REPO / "configs" / "hybrid.yaml"),
        *GROUP_MESH,
        "--trainer.strategy.replica_groups.group=0",
        "--trainer.strategy.replica_groups.num_groups=2",
        cwd=tmp_path,
        TORCHFT_LIGHTHOUSE="",
    )
    assert proc.returncode == 2 and "parallelkit: error: replica_groups has no lighthouse" in proc.stderr, proc.stderr
    # `parallelkit check` (here its dry run) builds the strategy as `fit` does: a lighthouse nothing answers at
    group = ("--trainer.strategy.replica_groups.group=0", "--trainer.strategy.replica_groups.num_groups=2")
    lighthouse = (
        f"--trainer.strategy.replica_groups.lighthouse={unreachable}",
        "--trainer.strategy.replica_groups.timeout=2",
    )
    proc = parallelkit(
        "check",
        "--dry-run",
        "--config",
        str(REPO / "configs" / "hybrid.yaml"),
        *GROUP_MESH,
        *group,
        *lighthouse,
        cwd=tmp_path,
    )
    assert proc.returncode == 2 and f"lighthouse={unreachable}: nothing answers there" in proc.stderr, proc.stderr


def killed_at_step_6(tmp_path, corpus, when: str):
    """Group 1 SIGKILLed whole at step 6 (`models.KillGroupAt`), `between_steps` (as the step starts, before it asks
    for the step's quorum) or `inside_the_all_reduce` (after its backward, before the gradients cross groups); both
    groups launched together (`models.StartTogether`). Group 0's log directory."""
    logs = [tmp_path / when / f"group{g}" for g in (0, 1)]
    together = callback("models.StartTogether", directory=str(tmp_path / when / "started"), count=2)
    kill = callback("models.KillGroupAt", step=6, when=when)
    with running_lighthouse(tmp_path, "--min-groups", "1", "--heartbeat-timeout-ms", "1000") as address:
        jobs = [launch(group_args(corpus, logs[g], g, address, together, *[kill][:g]), cwd=tmp_path) for g in (0, 1)]
        try:
            assert jobs[0].wait(timeout=180) == 0, jobs[0].stderr()[-4000:]
            assert jobs[1].wait(timeout=30) == -signal.SIGKILL
        finally:
            for job in jobs:
                if job.poll() is None:
                    job.kill()
    return logs[0]


def test_a_group_killed_mid_run_leaves_the_other_committing_every_step_once_on_its_batch(tmp_path, corpus):
    """Group 1 SIGKILLed at step 6, once between steps and once inside the gradients' all-reduce. Group 0 never stops:
    it trains every one of its 20 steps, each committed exactly once (torchft's committed count 1..20 against
    Lightning's steps: none lost, none repeated), alone from the kill on. Killed inside the all-reduce, the step
    fails to commit and is tried again on the same batch with a new quorum: the survivor's losses are then those of
    the run whose peer left between steps, step for step (the same groups took part in every committed step)."""
    survivor = {when: killed_at_step_6(tmp_path, corpus, when) for when in ("between_steps", "inside_the_all_reduce")}
    for log in survivor.values():
        committed = step_losses(log, "ft/committed_steps")
        assert sorted(committed) == list(range(20)) and list(committed.values()) == [float(s) for s in range(1, 21)]
        participants = step_losses(log, "ft/participants")
        assert participants[5] == 2.0 and participants[19] == 1.0, participants
    # Between steps, group 0's next quorum leaves group 1 out (its heartbeat stops); inside, the step is tried again.
    retries = {when: step_losses(log, "ft/retries")[19] for when, log in survivor.items()}
    assert retries == {"between_steps": 0.0, "inside_the_all_reduce": 1.0}, retries
    assert_same_losses(step_losses(survivor["between_steps"]), step_losses(survivor["inside_the_all_reduce"]), 1e-6)
