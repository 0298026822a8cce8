"""Replica groups (`replica_groups`, torchft): separately launched groups of processes that train as one
data-parallel job, each step's quorum formed by a lighthouse, gradients averaged across groups by torchft's manager."""

import contextlib
import json
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from snippets import parallelkit_args
from support import (
    REPO,
    SFT_GPT,
    SFT_ONE_PROCESS,
    STEPS,
    assert_ok,
    assert_same_losses,
    callback,
    checkpoint_every,
    common,
    fit,
    free_port,
    in_repo,
    launch,
    parallelkit,
    slack,
    step_losses,
)

from parallelkit.errors import ConfigError
from parallelkit.mesh import MeshSpec
from parallelkit.parallel.replica_groups import ReplicaGroups

GROUP_MESH = ('--trainer.strategy.mesh_shape=[[2], ["fsdp"]]', "--trainer.devices=2")


FAULT_STEPS = 20
"""The length of the runs a group is killed in: room for the kill, the group's return and steps after it."""


def group_args(corpus, log, group: int, lighthouse: str, *extra: str, steps: int = STEPS) -> list[str]:
    """The multi-node guide's group command (hybrid.yaml, [[2], ["fsdp"]] inside each group, 2 samples per process: a
    global batch of 2 x 2 x 2 = 8, one process's baseline) as group `group`, on the suite's corpus."""
    command = in_repo(parallelkit_args("replica-groups", 1, **{"http://HOST:29510": lighthouse}))
    assert "--trainer.strategy.replica_groups.group=0" in command
    command = [arg.replace("replica_groups.group=0", f"replica_groups.group={group}") for arg in command]
    return [
        *command,
        *common(corpus, log / "cache", steps),
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
        deadline = time.time() + slack(60)
        while not (job.directory / "stdout").exists() or "lighthouse at " not in job.stdout():
            assert job.poll() is None and time.time() < deadline, job.stdout() + job.stderr()
            time.sleep(0.05)
        address = job.stdout().split()[2].rstrip(":")  # "lighthouse at http://HOST:PORT: start each group with ..."
        yield f"http://127.0.0.1:{address.rsplit(':', 1)[1]}"  # this machine's name may not resolve on every machine
    finally:
        job.kill(signal.SIGTERM)
    assert job.wait(timeout=30) == 0, job.stderr()


@contextlib.contextmanager
def none_left(jobs: list):
    """`jobs` (appended to as the block goes on), each still running when the block ends killed."""
    try:
        yield jobs
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()


@pytest.fixture(scope="module")
def lighthouse(tmp_path_factory):
    """A lighthouse for 2 groups: no quorum forms until both have joined."""
    with running_lighthouse(tmp_path_factory.mktemp("lighthouse")) as address:
        yield address


def test_two_replica_groups_train_as_one_process_and_end_bit_identical(tmp_path, corpus, baseline):
    """2 groups x [[2], ["fsdp"]], each its own launch, group 1 launched 2 s after group 0 has started, on a lighthouse
    that forms a quorum with 1 group: group 0's first step waits for group 1 (a job's first step waits for all its
    groups), so every step has both in its quorum and commits; both log one process's loss (fp32, 1e-5: `train_loss`
    is averaged across the groups too) and end with the same parameters and AdamW state, shard by shard. Group 1
    launched again once both have finished finds no group to start with or copy from: it stops within its
    quorum_timeout, saying the job may have finished, instead of training a run of its own from step 0."""
    logs = [tmp_path / f"group{g}" for g in (0, 1)]
    started = tmp_path / "started"
    with running_lighthouse(tmp_path, "--min-groups", "1") as address:
        first = launch(
            group_args(corpus, logs[0], 0, address, callback("models.Touch", path=str(started))), cwd=tmp_path
        )
        with none_left([first]) as jobs:
            deadline = time.monotonic() + slack(120)
            while not started.exists():
                assert first.poll() is None and time.monotonic() < deadline, first.stderr()[-4000:]
                time.sleep(0.05)
            time.sleep(2.0)
            jobs.append(launch(group_args(corpus, logs[1], 1, address), cwd=tmp_path))
            for job in jobs:
                assert job.wait(timeout=300) == 0, job.stderr()[-4000:]
            late = group_args(
                corpus, tmp_path / "late", 1, address, "--trainer.strategy.replica_groups.quorum_timeout=3"
            )
            jobs.append(launch(late, cwd=tmp_path))
            assert jobs[2].wait(timeout=120) != 0
    assert re.search(
        r"groups \[0\] did not join within quorum_timeout=3 s .*job already finished.*Fix:", jobs[2].stderr()
    )
    assert not list((tmp_path / "late").rglob("metrics.csv")) or not step_losses(tmp_path / "late")
    for log in logs:  # each group logs the job's loss: its own rows' averaged with the other's
        assert_same_losses(baseline("plain").losses(), step_losses(log))
    for log in logs:
        assert set(step_losses(log, "ft/participants").values()) == {2.0}
        assert set(step_losses(log, "ft/groups").values()) == {3.0}
        assert list(step_losses(log, "ft/committed_steps").values()) == [float(s) for s in range(1, STEPS + 1)]
    for rank in (0, 1):
        digests = [json.loads((log / "digest" / f"rank{rank}.json").read_text()) for log in logs]
        assert digests[0] == digests[1] and digests[0]["optimized"] > 0, digests


def two_groups(directory: Path, lighthouse: str, config: str, strategy: tuple, *extra: str) -> list[Path]:
    """configs/`config` launched as groups 0 and 1 of 2 (`strategy`: the strategy's class and layout inside each
    group, then the replica-group options and `extra`), each in its own directory (its logs, and the checkpoints a
    config writes relative to it), started together; both must exit 0. Their log directories."""
    logs = [directory / f"group{g}" for g in (0, 1)]
    together = callback("models.StartTogether", directory=str(directory / "started"), count=2)
    commands = [
        [
            "fit",
            "--config",
            str(REPO / "configs" / config),
            *strategy,
            f"--trainer.strategy.replica_groups.group={g}",
            "--trainer.strategy.replica_groups.num_groups=2",
            f"--trainer.strategy.replica_groups.lighthouse={lighthouse}",
            "--trainer.strategy.replica_groups.hostname=127.0.0.1",
            "--trainer.strategy.replica_groups.timeout=30",
            f"--trainer.logger.init_args.save_dir={log}",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            callback("models.StateDigest", out_dir=str(log / "digest")),
            together,
            *extra,
        ]
        for g, log in enumerate(logs)
    ]
    for log in logs:
        log.mkdir(parents=True)
    with none_left([launch(command, cwd=log) for command, log in zip(commands, logs)]) as jobs:
        codes = [job.wait(timeout=300) for job in jobs]
    assert codes == [0, 0], [job.stderr()[-4000:] for job in jobs]
    return logs


LAYOUTS_IN_GROUPS = {
    # SFT packed rows (each step's loss divided by the targets of the groups taking part), cp2 inside each group,
    # 2 accumulated micro-batches of 2 rows a group: the global batch of 8 rows of one process. Step 2's commit fails
    # in both groups (both try it again, its first micro-batch run again); step 4's in group 1 alone (the other
    # commits it: group 1 falls behind and heals in place).
    "cp2_sft_packed_accumulate2": (
        "sft.yaml",
        ('--trainer.strategy.mesh_shape=[[2], ["cp"]]', "--trainer.devices=2"),
        *SFT_GPT,
        "--data.init_args.batch_size=2",
        "--trainer.accumulate_grad_batches=2",
        callback("models.FailCommit", step=2, groups=[0, 1]),
        callback("models.FailCommit", step=4, groups=[1]),
    ),
    "1f1b_pp2_fsdp2": (
        "hybrid.yaml",
        (
            "--trainer.strategy=parallelkit.PipelineStrategy",
            '--trainer.strategy.mesh_shape=[[2, 2], ["pp", "fsdp"]]',
            "--trainer.strategy.schedule=1f1b",
            "--trainer.strategy.microbatches=2",
            "--trainer.devices=4",
        ),
        "--data.init_args.batch_size=2",
    ),
    "ddp2": ("ddp.yaml", ("--trainer.strategy=parallelkit.DDPStrategy",), "--data.init_args.batch_size=2"),
}


@pytest.mark.parametrize("layout", LAYOUTS_IN_GROUPS)
def test_every_layout_inside_two_groups_equals_one_process(tmp_path, corpus, baseline, sft_runs, lighthouse, layout):
    """2 groups, each a launch of its own with a pipeline (1F1B, pp2 x fsdp2), cp2 with SFT packed rows and 2
    accumulated micro-batches, or DDP inside: every step commits once in each group and both log one process's loss
    on the same global batch (fp32, 1e-5), ending with the same parameters and optimizer state, rank by rank. With
    cp2/SFT, commits that fail: in both groups (each tries the step again on the same micro-batches), and in one
    alone (it copies the other's state in place, as the step's result, and goes on with it)."""
    config, strategy, *extra = LAYOUTS_IN_GROUPS[layout]
    if config == "sft.yaml":
        reference = step_losses(sft_runs("gpt_one", *SFT_ONE_PROCESS, *SFT_GPT))
        data = [f"--data.init_args.cache_dir={tmp_path / 'cache'}"]
    else:
        reference = baseline("plain").losses()
        data = common(corpus, tmp_path / "cache", STEPS)[2:]
    budget = [f"--trainer.max_steps={STEPS}", "--trainer.limit_val_batches=0"]
    logs = two_groups(tmp_path, lighthouse, config, strategy, *budget, *data, *extra)
    for log in logs:
        assert_same_losses({step: reference[step] for step in range(STEPS)}, step_losses(log))
        assert set(step_losses(log, "ft/groups").values()) == {3.0}
        assert list(step_losses(log, "ft/committed_steps").values()) == [float(s) for s in range(1, STEPS + 1)]
        # FSDP2's units reduced across groups during backward (every gradient); DDP's after it
        assert set(step_losses(log, "ft/overlapped").values()) == ({0.0} if layout == "ddp2" else {1.0}), layout
    for rank in range(4 if "fsdp2" in layout else 2):
        digests = [json.loads((log / "digest" / f"rank{rank}.json").read_text()) for log in logs]
        assert digests[0] == digests[1] and digests[0]["optimized"] > 0, digests
    if "sft" in layout:
        retries = [step_losses(log, "ft/retries") for log in logs]
        assert [retries[0][STEPS - 1], retries[1][STEPS - 1]] == [1.0, 2.0], retries
        healed = step_losses(logs[1], "ft/copied_steps")
        assert [healed[step] for step in (3, 4)] == [0.0, 1.0] and step_losses(logs[1], "ft/committed")[4] == 0.0


def test_what_replica_groups_cannot_take_is_refused_before_launch(tmp_path, monkeypatch):
    """A group index outside the job's, no lighthouse, one nothing answers at, a mesh with its own replicate axis (the
    groups are that axis: the fix names the spelling), and torchft missing: each refused naming the field and the fix
    (the CLI, fit and check: one process, before any rank starts)."""
    mesh = MeshSpec.parse([[2], ["fsdp"]])
    with pytest.raises(ConfigError, match=r"replica_groups.group=2 with num_groups=2: .*Fix: launch group i of n"):
        ReplicaGroups(group=2, num_groups=2, lighthouse="http://h:1").check(mesh)
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match=r"no lighthouse.*parallelkit lighthouse"):
        ReplicaGroups(group=0, num_groups=2).check(mesh)
    with pytest.raises(ConfigError, match=r"no replicate axis of its own.*one group per replica"):
        hsdp = MeshSpec.parse([[2, 2], ["replicate", "fsdp"]])
        ReplicaGroups(group=0, num_groups=2, lighthouse="http://h:1").check(hsdp)
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


ACCUMULATED = (
    "--data.init_args.batch_size=1",
    "--trainer.accumulate_grad_batches=2",
    "--model=models.GPTCountingSteps",
    "--model.init_args.n_layer=2",
    "--model.init_args.n_head=4",
    "--model.init_args.n_embd=64",
)
"""The kill tests' groups: 2 micro-batches of 1 row a process per step (the same global batch of 8 rows), on
hybrid.yaml's GPT with a buffer that training changes (`models.GPTCountingSteps`: the returning group must copy it)."""

SFT_ROWS = (
    "--data=parallelkit.data.SFTDataModule",
    "--data.init_args.paths=null",
    "--data.init_args.seq_len=256",
    "--model.init_args.vocab_size=264",
)
"""configs/sft.yaml's data (the built-in conversations, packed rows of 256 tokens) instead of the corpus' windows:
each step's loss is divided by the targets of the groups that take part in it."""

DATA = {"between_steps": SFT_ROWS, "inside_the_all_reduce": ()}
"""Each kill test's data: one on token batches, one on fixed windows."""


def killed_and_back(tmp_path, corpus, when: str) -> dict[str, Path]:
    """Group 1 SIGKILLed whole at step 6 (`models.KillGroupAt`), `between_steps` (as the step starts, before it asks
    for the step's quorum) or `inside_the_all_reduce` (after the step's last backward, before the gradients cross
    groups), and launched again once group 0 has gone on alone to step 10; group 0 waits for it at step 12
    (`models.HoldAt`, so that it comes back mid-run however long its start takes). Both first launched together
    (`models.StartTogether`), each step 2 accumulated micro-batches (`ACCUMULATED`). The log directories: `survivor`,
    `returned`."""
    base = tmp_path / when
    logs = {"survivor": base / "group0", "killed": base / "group1", "returned": base / "group1-back"}
    alone, back = base / "alone", base / "back"
    together = callback("models.StartTogether", directory=str(base / "started"), count=2)
    survivor = (
        together,
        callback("models.Touch", path=str(alone), step=10),
        callback("models.HoldAt", step=12, path=str(back), after=2.0),  # its join request comes right after
        *ACCUMULATED,
        *DATA[when],
    )
    killed = (together, callback("models.KillGroupAt", step=6, when=when), *ACCUMULATED, *DATA[when])
    with running_lighthouse(tmp_path, "--min-groups", "1", "--heartbeat-timeout-ms", "1000") as address:
        first = [
            launch(group_args(corpus, logs["survivor"], 0, address, *survivor, steps=FAULT_STEPS), cwd=tmp_path),
            launch(group_args(corpus, logs["killed"], 1, address, *killed, steps=FAULT_STEPS), cwd=tmp_path),
        ]
        with none_left(first) as jobs:
            assert jobs[1].wait(timeout=180) == -signal.SIGKILL, jobs[1].stderr()[-4000:]
            deadline = time.monotonic() + slack(180)
            while not alone.exists():
                assert jobs[0].poll() is None and time.monotonic() < deadline, jobs[0].stderr()[-4000:]
                time.sleep(0.02)
            returned = callback("models.Touch", path=str(back))
            again = group_args(
                corpus, logs["returned"], 1, address, returned, *ACCUMULATED, *DATA[when], steps=FAULT_STEPS
            )
            jobs.append(launch(again, cwd=tmp_path))
            for job in (jobs[0], jobs[2]):
                assert job.wait(timeout=180) == 0, job.stderr()[-4000:]
    return logs


_replays: dict[str, dict[int, float]] = {}


def replay(tmp_path, corpus, schedule: list[list[int]], tokens: bool) -> dict[int, float]:
    """One process's per-step losses fed, at each step, the rows of the groups `schedule` lists for it
    (`models.ReplayText`, or `models.ReplaySFT` for `tokens`: SFT_ROWS' packed rows, divided by their targets), out
    of 2 groups of 2 processes with 2 micro-batches of 1 row each: single.yaml's run otherwise."""
    key = json.dumps([schedule, tokens])
    if key not in _replays:
        log = tmp_path / f"replay{len(_replays)}"
        replayed = "models.ReplaySFT" if tokens else "models.ReplayText"
        data = [f"--data.class_path={replayed}", f"--data.init_args.schedule={json.dumps(schedule)}"]
        if tokens:
            data += SFT_ROWS[1:]  # the class is ReplaySFT already
        sizes = [
            "--data.init_args.num_groups=2",
            "--data.init_args.group_size=2",
            "--data.init_args.batch_size=1",
            "--data.init_args.accumulate=2",
        ]
        accumulate = "--trainer.accumulate_grad_batches=2"
        assert_ok(fit("single.yaml", log, *common(corpus, log / "cache", FAULT_STEPS), *data, *sizes, accumulate))
        _replays[key] = step_losses(log)
    return _replays[key]


def test_a_killed_group_comes_back_healed_from_the_survivor_and_both_equal_a_one_process_replay(tmp_path, corpus):
    """Groups of 2 accumulated micro-batches a step. Group 1 SIGKILLed at step 6, once between steps and once inside
    the gradients' all-reduce, then launched again. Group 0 trains on alone from the kill (it is held at step 12
    until group 1's relaunch has started: a forked one starts in well under a second) and commits each of its 20 steps
    exactly once (torchft's committed count 1..20 against Lightning's steps). Killed inside the all-reduce, the step is
    tried again with the groups left on the same micro-batches (the first run again). Group 1 comes back at the step
    group 0 is at: it copies group 0's model, buffers (`steps_seen`), optimizer and training position and continues
    from there (its first logged step is that one, committed once); both end with bit-identical parameters, buffers
    and AdamW state. Every step's loss (the job's: both groups log it) equals that of one process fed exactly the rows
    of the groups that took part (logged as `ft/groups`), fp32, 1e-5."""
    for when in ("between_steps", "inside_the_all_reduce"):
        logs = killed_and_back(tmp_path, corpus, when)
        survivor, returned = step_losses(logs["survivor"]), step_losses(logs["returned"])
        committed = step_losses(logs["survivor"], "ft/committed_steps")
        assert sorted(committed) == list(range(FAULT_STEPS))
        assert list(committed.values()) == [float(s) for s in range(1, FAULT_STEPS + 1)]
        groups = step_losses(logs["survivor"], "ft/groups")
        schedule = [[g for g in (0, 1) if int(groups[step]) >> g & 1] for step in range(FAULT_STEPS)]
        rejoined = step_losses(logs["returned"], "ft/committed_steps")
        back = min(rejoined)  # the step group 1 came back at: 12, or later if group 0 asked for a quorum first
        # (both are in the first quorum unless group 1's first heartbeat came late: it then joined a step later)
        assert all(groups in ([0, 1], [0]) for groups in schedule[:6]) and schedule[5] == [0, 1], schedule
        assert 12 <= back < FAULT_STEPS, schedule
        assert schedule[6:] == [[0]] * (back - 6) + [[0, 1]] * (FAULT_STEPS - back), schedule
        assert list(rejoined.items()) == [(step, float(step + 1)) for step in range(back, FAULT_STEPS)], rejoined
        copied = {log: set(step_losses(logs[log], "ft/copied_steps").values()) for log in ("survivor", "returned")}
        assert copied == {"survivor": {0.0}, "returned": {float(back)}}, copied
        retries = step_losses(logs["survivor"], "ft/retries")[FAULT_STEPS - 1]
        assert retries == {"between_steps": 0.0, "inside_the_all_reduce": 1.0}[when], (when, retries)
        reference = replay(tmp_path, corpus, schedule, tokens=bool(DATA[when]))
        assert_same_losses(reference, survivor)
        assert_same_losses({step: reference[step] for step in returned}, returned)
        for rank in (0, 1):
            digests = [
                json.loads((logs[g] / "digest" / f"rank{rank}.json").read_text()) for g in ("survivor", "returned")
            ]
            assert digests[0] == digests[1] and digests[0]["optimized"] > 0, (when, digests)


def test_every_group_restarted_after_a_kill_during_a_save_resumes_exactly_the_furthest_checkpoint(
    tmp_path, corpus, reference
):
    """Each group checkpoints every 4 steps in its own directory. Group 1 loses a rank in the middle of its step-8
    save (`models.KillDuringSave`: its step-8 checkpoint stays `.partial`, its last is step 4), group 0 is killed
    at step 10 (its last: step 8). Both relaunched with `--ckpt_path=last`: group 0 resumes at 8 from its own
    checkpoint (torchft's committed count with it), group 1 from step 4's, behind, copies group 0's state as it joins;
    both go on from step 8, exactly the uninterrupted run's (one process's losses, 1e-5), and end bit-identical."""
    logs = [tmp_path / f"group{g}" for g in (0, 1)]
    saves = [checkpoint_every(log / "ckpt", 4, last=True) for log in logs]
    kills = [
        callback("models.KillGroupAt", step=10, when="between_steps"),
        callback("models.KillDuringSave", step=8),
    ]
    # Killed: group 0 goes on alone once group 1 is gone. Resumed: the first quorum waits for both groups.
    for attempt, extra, groups in (("killed", kills, "1"), ("resumed", ["--ckpt_path=last"] * 2, "2")):
        with running_lighthouse(tmp_path, "--min-groups", groups, "--heartbeat-timeout-ms", "1000") as address:
            together = callback("models.StartTogether", directory=str(tmp_path / attempt), count=2)
            run = [
                group_args(corpus, logs[g], g, address, together, saves[g], extra[g], steps=FAULT_STEPS) for g in (0, 1)
            ]
            with none_left([launch(command, cwd=tmp_path) for command in run]) as jobs:
                codes = [job.wait(timeout=180) for job in jobs]
            if attempt == "killed":
                assert codes[0] == -signal.SIGKILL and codes[1] != 0, [job.stderr()[-3000:] for job in jobs]
                assert sorted(p.name for p in (logs[1] / "ckpt").iterdir()) == [
                    "epoch=0-step=4.ckpt",
                    "epoch=0-step=8.ckpt.partial",
                    "last.ckpt",
                ]
            else:
                assert codes == [0, 0], [job.stderr()[-3000:] for job in jobs]
    straight = reference("single.yaml", f"--trainer.max_steps={FAULT_STEPS}").losses()  # one process, as long
    for log in logs:
        resumed = step_losses(log)
        assert sorted(resumed) == list(range(8, FAULT_STEPS)), resumed
        assert_same_losses({step: straight[step] for step in resumed}, resumed)
        assert list(step_losses(log, "ft/committed_steps").values()) == [float(s) for s in range(9, FAULT_STEPS + 1)]
    copied = [set(step_losses(log, "ft/copied_steps").values()) for log in logs]
    assert copied == [{0.0}, {4.0}], copied  # group 1's checkpoint was 4 steps behind group 0's
    for rank in (0, 1):
        digests = [json.loads((log / "digest" / f"rank{rank}.json").read_text()) for log in logs]
        assert digests[0] == digests[1], digests


def test_groups_launched_wrong_together_both_fail_naming_why_without_hanging(tmp_path, corpus, lighthouse):
    """Two launches given the same group index, then two whose meshes differ ([[2], ["fsdp"]] and [[1, 2], ["fsdp",
    "tp"]]: their gradients' shards do not match): both groups of each pair exit at once (the first quorum; the
    first all-reduce), each naming the problem and the fix."""
    cases = {
        "same index": ((0, ()), (0, ())),
        "other layout": ((0, ()), (1, ('--trainer.strategy.mesh_shape=[[1, 2], ["fsdp", "tp"]]',))),
    }
    expected = {
        "same index": r"group 0 is in the quorum twice: two launches were given replica_groups.group=0.*Fix: launch",
        "other layout": r"not every group of this quorum has this group's layout \(2 processes on mesh_shape .*Fix:",
    }
    for case, groups in cases.items():
        base = tmp_path / case.replace(" ", "-")
        together = callback("models.StartTogether", directory=str(base / "started"), count=2)
        commands = [
            group_args(corpus, base / f"launch{i}", g, lighthouse, together, *extra)
            for i, (g, extra) in enumerate(groups)
        ]
        with none_left([launch(command, cwd=tmp_path) for command in commands]) as jobs:
            codes = [job.wait(timeout=120) for job in jobs]
        for code, job in zip(codes, jobs):
            assert code != 0 and re.search(expected[case], job.stderr()), (case, job.stderr()[-3000:])
