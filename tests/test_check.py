"""`parallelkit check`, launched as `fit` is (Lightning's launcher, 4 CPU processes, gloo) on the configs' meshes: the
per-axis figures against a plain timed loop, and the faults it must name without hanging (injected by
`tests/faults/sitecustomize.py`)."""

import json
import sys
import time

import pytest
from snippets import commands, parallelkit_args
from support import FSDP4, REPO, TESTS, assert_ok, in_repo, parallelkit, run, slack, torchrun

from parallelkit.check.collectives import Measurement, axis_groups
from parallelkit.check.live import Options, Result, judge
from parallelkit.mesh import MeshSpec

FAULTS = str(TESTS / "faults")
QUICK = ["--sizes", "64KiB,1MiB", "--iters", "3"]


def check(tmp_path, config, *args, fault=None, timeout=300):
    env = {"PYTHONPATH": FAULTS, "PARALLELKIT_CHECK_FAULT": json.dumps(fault)} if fault else {}
    start = time.monotonic()
    proc = parallelkit("check", "--config", str(REPO / "configs" / config), *args, cwd=tmp_path, timeout=timeout, **env)
    return proc, time.monotonic() - start


@pytest.mark.parametrize(
    ("config", "axes", "launcher"),
    [
        ("hybrid.yaml", {"fsdp", "tp"}, "lightning"),
        ("3d.yaml", {"pp", "tp"}, "torchrun"),
        ("long_context.yaml", {"cp"}, "lightning"),
    ],
)
def test_check_times_every_axis_of_the_configs_mesh_and_passes(tmp_path, config, axes, launcher):
    """The check guide's three commands, launched as `fit` is, by Lightning's launcher or torchrun: exit 0 and, for
    every axis of size > 1, each of its collectives at each size (on a cp axis, the all-to-all too) with a latency and
    a bus bandwidth; on hybrid.yaml, tp's all-reduce of 1 MiB within 10x either way of a plain timed loop of the same
    call on the same pairs of ranks."""
    launched = next(command for command in commands("check") if f"configs/{config}" in command)  # the guide's
    assert f"configs/{config}" in launched
    if launcher == "torchrun":
        assert launched[0] == "torchrun"
        proc = run([sys.executable, "-m", "torch.distributed.run", *in_repo(launched[1:]), "--json", *QUICK], tmp_path)
    else:
        assert launched[0] == "parallelkit"
        proc = parallelkit(*in_repo(launched[1:]), "--json", *QUICK, cwd=tmp_path)
    assert_ok(proc)
    result = json.loads(proc.stdout[proc.stdout.index("{\n") :])
    assert result["passed"] and not result["failures"]
    assert [r["rank"] for r in result["ranks"]] == [0, 1, 2, 3]
    assert {r["launcher"] for r in result["ranks"]} == {launcher}
    measured = {(m["axis"], m["op"], m["bytes"]): m for m in result["measurements"]}
    ops = {"pp": ["send_recv"], "cp": ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]}.get
    for axis in axes:
        for op in ops(axis, ["all_reduce", "all_gather", "reduce_scatter"]):
            for size in (64 * 1024, 1024 * 1024):
                m = measured[(axis, op, size)]
                assert m["latency_us"] > 0 and m["busbw_gbps"] > 0, m
                n = m["group_size"]
                factor = {"all_reduce": 2 * (n - 1) / n, "send_recv": 1.0}.get(op, (n - 1) / n)
                assert m["busbw_gbps"] == pytest.approx(factor * m["algbw_gbps"])
    assert {m["axis"] for m in result["measurements"]} == axes
    if config == "hybrid.yaml":
        plain = torchrun("timed_all_reduce.py", 4, str(1024 * 1024), "3", cwd=tmp_path)
        assert_ok(plain)
        reference = json.loads(plain.stdout.strip().splitlines()[-1])["seconds"] * 1e6
        ours = measured[("tp", "all_reduce", 1024 * 1024)]["latency_us"]
        assert reference / 10 < ours < reference * 10, (ours, reference)


def test_a_rank_that_never_joins_is_named_within_the_deadline(tmp_path):
    """The deadline counts from the last rank that joined: ranks 1-2 may start as slowly as a loaded machine starts
    them (the suite's own load once kept them out of a 20 s wait counted from rank 0's start), and 5 s between two
    forked ranks' joins is stretched by the machine's load (`slack`); the test then waits out the deadline for rank
    3."""
    deadline = round(slack(5))
    proc, seconds = check(
        tmp_path, "hybrid.yaml", "--join-deadline", str(deadline), *QUICK, fault={"rank": 3, "never_join": True}
    )
    assert proc.returncode != 0
    assert "rank 3 never joined: 3 of 4 ranks reached rank 0" in " ".join(proc.stdout.split())
    assert seconds < deadline + 600, seconds  # the deadline and start-up, however slow, not the hour the rank sleeps


def test_a_rank_that_stalls_mid_check_is_named_with_its_call_and_nothing_hangs(tmp_path):
    """Rank 2 stops at its first all-gather (the fsdp group of ranks 0, 2 on [[2, 2]]); its tp partner times out
    earlier, in all-reduce; rank 0 names rank 2 and the call, then ends the stalled process."""
    proc, seconds = check(tmp_path, "hybrid.yaml", "--deadline", "5", *QUICK, fault={"rank": 2, "stall": "all_gather"})
    assert proc.returncode != 0
    out = " ".join(proc.stdout.split())
    assert "rank 2 stopped answering during: all_gather of 64 KiB on the fsdp group of ranks 0, 2" in out
    assert "rank 3 waited in: all_reduce" in out
    assert seconds < slack(120), seconds  # the check's 5-second deadline ends it, not a hang


def test_a_rank_on_another_kind_of_device_fails_the_check_naming_it(tmp_path):
    proc, _ = check(tmp_path, "hybrid.yaml", *QUICK, fault={"rank": 1, "report": {"device": "NVIDIA A100-SXM4-40GB"}})
    assert proc.returncode == 1
    out = " ".join(proc.stdout.split())
    assert "devices are not homogeneous: device: rank 1 reports 'NVIDIA A100-SXM4-40GB', where the other ranks" in out
    assert "--allow-mixed" in out


def dry_run_json(tmp_path, *args):
    proc = parallelkit(*args, "--json", cwd=tmp_path)
    assert_ok(proc)
    return json.loads(proc.stdout[proc.stdout.index("{\n") :])


def dry_run(tmp_path, config, *args):
    return dry_run_json(tmp_path, "check", "--dry-run", "--config", str(config), *args)


def test_dry_run_builds_every_rank_as_the_real_run_holds_it(tmp_path, fsdp4_fp32):
    """hybrid.yaml on [[4, 1]] built rank by rank in one process (fake process group, meta model): each rank's
    parameter and gradient bytes equal those the session's real run of that layout held (`models.StateBytes`), and
    the planner's figure equals them too."""
    out = dry_run(tmp_path, REPO / "configs" / "hybrid.yaml", *FSDP4, "--rank", "all")
    assert out["mesh"] == '[[4, 1], ["fsdp", "tp"]]' and len(out["ranks"]) == 4
    for built in out["ranks"]:
        real = json.loads((fsdp4_fp32 / "state" / f"rank{built['rank']}.json").read_text())
        assert (built["params"], built["grads"]) == (real["params"], real["grads"])
        assert built["optimizer"] == pytest.approx(real["optimizer"], rel=0.01)  # AdamW's step counters aside
    assert out["planner"]["params"] == pytest.approx(max(r["params"] for r in out["ranks"]), rel=0.1)


def test_dry_run_applies_the_70b_presets_3d_plan_for_a_64_rank_cluster_in_one_process(tmp_path):
    """Llama-3.1-70B on [[4, 2, 8], ["pp", "fsdp", "tp"]] (8 nodes of 8), the first rank of the first stage and the
    last rank of the last: each holds a quarter of the layers, split 16 ways; the planner's figure within 10%."""
    # The check guide's command: a registered name and its class's options.
    out = dry_run_json(tmp_path, *in_repo(parallelkit_args("check-dry-run", 0)))
    first, last = out["ranks"]
    assert out["world_size"] == 64
    assert (first["coordinates"], first["stages"]) == ({"pp": 0, "fsdp": 0, "tp": 0}, [0])
    assert (last["coordinates"], last["stages"]) == ({"pp": 3, "fsdp": 1, "tp": 7}, [3])
    whole = 70_553_706_496 * 4  # fp32 parameters (bf16-mixed keeps fp32 masters)
    for rank in (first, last):
        assert whole / 64 * 0.9 < rank["params"] < whole / 64 * 1.1, rank
    planned = out["planner"]["params"] + out["planner"]["grads"] + out["planner"]["optimizer"]
    assert planned == pytest.approx(max(r["state"] for r in out["ranks"]), rel=0.1)


def test_a_presets_dry_run_plans_an_auto_mesh_for_the_clusters_device_memory(tmp_path):
    """Llama-3.1-8B's preset with fsdp_tp by its registered name and `mesh_shape: auto`, for 8 devices of 80 GB
    (`--device-memory`; this machine's memory over 8 fits no layout: test_errors.py): the planner's mesh is built,
    and its estimated peak fits the memory less the 10% headroom (fsdp=8, estimated at 72.9 GB, does not)."""
    out = dry_run_json(tmp_path, *in_repo(parallelkit_args("check-dry-run", 1)))  # the check guide's command
    assert out["mesh"] == '[[4, 2], ["fsdp", "tp"]]' and out["world_size"] == 8
    assert out["ranks"][0]["params"] == pytest.approx(8_030_261_248 * 4 / 8, rel=0.01)  # fp32 masters, an eighth
    assert out["planner"]["fits"] and out["planner"]["peak"] <= 0.9 * 80e9  # the headroom `plan` and auto keep


def test_a_dry_runs_auto_mesh_that_fits_only_checkpointed_names_the_setting(tmp_path):
    """hybrid.yaml's GPT with `mesh_shape: auto` on 4 devices of 1.5 MB, 20% of it kept free (`--memory-headroom`, 10%
    by default), fits no layout with its own settings: the refusal names the activation checkpointing and batch that
    `plan`'s search finds fitting (that they fit, and that `recommend` names them:
    test_planner.py::test_an_auto_mesh_that_fits_only_checkpointed_names_the_setting)."""
    run = ("check", "--dry-run", "--config", str(REPO / "configs" / "hybrid.yaml"), "--device-memory", "1.5MB")
    refused = parallelkit(*run, "--memory-headroom", "20%", "--trainer.strategy.mesh_shape=auto", cwd=tmp_path)
    out = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode != 0 and "Traceback" not in out, out[-2000:]
    assert "fits no layout of 1 x 4 processes with 1.50 MB per device" in out
    assert "over the 1.20 MB usable of each 1.50 MB device (20% kept free)" in out
    assert "Fix: --trainer.strategy.activation_checkpointing=full --data.init_args.batch_size=2 " in out
    assert '(it fits: [[2, 2], ["fsdp", "tp"]], activation_checkpointing=full' in out


def test_the_verdict_names_a_tp_group_across_hosts_an_inner_axis_slower_than_an_outer_and_mixed_versions():
    """`judge` on made-up reports and timings: what a real cluster would show, without one."""
    spec = MeshSpec.parse('[[2, 2], ["fsdp", "tp"]]')
    base = {"device": "H100", "capability": "9.0", "device_memory": 80, "torch": "2.13", "cuda": "12.8", "nccl": "2.27"}
    base |= {"driver": "570", "python": "3.11", "parallelkit": "0.1"}
    hosts = ["a", "b", "a", "b"]  # tp pairs (0, 1) and (2, 3) each span both hosts
    result = Result(str(spec), [{**base, "rank": r, "host": hosts[r]} for r in range(4)])
    result.reports[2]["nccl"] = "2.21"
    for axis, seconds in (("fsdp", 0.001), ("tp", 0.01)):  # tp, the inner axis, 10x slower
        m = Measurement(axis, "all_reduce", 2**24, 2)
        m.seconds = {g: seconds for g in axis_groups(spec, axis)}
        result.measurements.append(m)
    judge(spec, result, Options(sizes=(2**24,)))
    warnings = " ".join(result.warnings)
    assert "tp crosses nodes: the tp group of ranks 0, 1 spans hosts a, b" in warnings
    assert "the inner axis tp (1.68 GB/s bus bandwidth) is slower than the outer axis fsdp (16.8 GB/s)" in warnings
    (failure,) = result.failures
    assert failure.startswith("devices are not homogeneous: nccl: rank 2 reports '2.21', where the other ranks report")
    judge(spec, mixed := Result(str(spec), result.reports), Options(allow_mixed=True))
    assert not mixed.failures and "allowed by --allow-mixed" in mixed.warnings[-1]
