"""Communication-precision hooks, held to the bytes they claim (measured by the profiler) and to the losses."""

import pytest
import torch
import torch.distributed as dist
from snippets import parallelkit_args
from support import LEARNED, STEPS, assert_ok, assert_same_losses, callback, fit, fit_command, step_losses
from support import common as run_args
from test_plugins import install_fake_distribution

from parallelkit.comm.int8 import Int8ReduceScatter
from parallelkit.models import GPT
from parallelkit.parallel import resolve

HSDP = [
    '--trainer.strategy.mesh_shape=[[2, 2], ["replicate", "fsdp"]]',
    "--trainer.devices=4",
    "--data.init_args.batch_size=2",
]


def common(corpus, cache, steps: int = STEPS) -> list[str]:
    return [*run_args(corpus, cache, steps), "--trainer.strategy.profile_communication=true"]


def reference_model() -> GPT:
    return GPT(n_layer=2, n_head=4, n_embd=64)  # configs' model: every dim divisible by 4, so FSDP adds no padding


FSDP2 = [
    '--trainer.strategy.mesh_shape=[[2, 1], ["fsdp", "tp"]]',
    "--trainer.devices=2",
    "--data.init_args.batch_size=4",
]
"""Where a property holds on any number of fsdp ranks: 2 processes, half the launch cost of [[4, 1]] on 2 cores."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, fsdp4_fp32):
    """[[4, 1]] runs under fp32, fp16 and int8 for `STEPS` steps (fp16 and int8: the communication guide's commands
    on configs/comm_bf16.yaml); bf16 as long under HSDP [[2, 2]] (replicate x fsdp),
    which reduce-scatters the same full gradient and all-reduces its shard over replicate too (fp32 under HSDP gives
    [[4, 1]]'s losses within ~1e-6); int8 under HSDP for 3 steps: each run's CSV log directory, by name. The fp32 run
    is the session's `fsdp4_fp32` (shared with test_fsdp_tp.py)."""
    root = tmp_path_factory.mktemp("comm")
    made = {"fp32": fsdp4_fp32}
    for index, (name, hook) in enumerate((("fp16", "fp16"), ("int8", "int8"))):  # the guide's commands
        args = parallelkit_args("comm-hooks", index)
        assert f"--trainer.strategy.comm_precision={hook}" in args
        assert_ok(fit_command(args, root / name, *common(corpus, root / "cache")))
        made[name] = root / name
    for name, hook, steps, layout in (
        ("bf16_hsdp", "bf16", STEPS, HSDP),
        ("int8_hsdp_3", "int8", 3, HSDP),
    ):
        assert_ok(
            fit(
                "hybrid.yaml",
                root / name,
                *common(corpus, root / "cache", steps),
                *layout,
                f"--trainer.strategy.comm_precision={hook}",
            )
        )
        made[name] = root / name
    return made


def test_fp32_gradient_bytes_equal_four_bytes_per_parameter_per_step(runs):
    params = sum(p.numel() for p in reference_model().parameters())
    per_step = step_losses(runs["fp32"], "comm/reduce_scatter_bytes")
    assert len(per_step) == STEPS
    # One reduce-scatter of every (unsharded, fp32) gradient per optimizer step.
    assert set(per_step.values()) == {4.0 * params}


def test_each_unit_is_gathered_once_in_forward_and_again_in_backward_only_if_resharded(runs):
    """All-gathered bytes per step on [[4, 1]]: every unit once in forward, and in backward again every block but
    the last (default reshard: the last block and the root keep their parameters for backward). The root, whose
    forward runs the whole training step, once: a step calling `self(x)` inside it must not reshard it at its end
    (which gathered the root, 131 KB here, a second time)."""
    model = reference_model()
    blocks = [sum(p.numel() for p in model.get_submodule(unit).parameters()) for unit in resolve(model).fsdp_units]
    root = sum(p.numel() for p in model.parameters()) - sum(blocks)
    fsdp = 4 * (root + sum(blocks) + sum(blocks[:-1]))
    gathered = step_losses(runs["fp32"], "comm/all_gather_bytes")
    # The rest is RankMonitor's gather of each rank's few statistics.
    assert all(0 <= value - fsdp < 1024 for value in gathered.values()), (fsdp, gathered)


def test_a_training_step_waits_on_no_barrier(runs):
    """Lightning's strategies run a barrier before each all-reduce of a `sync_dist` value: a blocking round trip per
    logged value per step, which the all-reduce itself makes redundant. parallelkit's reduce without it: a [[4, 1]]
    step's one all-reduce is the logged loss's, and no barrier is counted in any step."""
    assert "comm/barrier_count" not in next(runs["fp32"].rglob("metrics.csv")).read_text()
    assert set(step_losses(runs["fp32"], "comm/all_reduce_count").values()) == {1.0}


@pytest.mark.parametrize(("half", "full"), [("bf16_hsdp", "fp32"), ("fp16", "fp32")])
def test_half_precision_hooks_halve_gradient_bytes(runs, half, full):
    full_bytes = step_losses(runs[full], "comm/reduce_scatter_bytes")
    half_bytes = step_losses(runs[half], "comm/reduce_scatter_bytes")
    assert sorted(half_bytes) == sorted(full_bytes)
    for step in full_bytes:
        assert half_bytes[step] * 2 == full_bytes[step]  # exactly: 2 bytes per gradient element instead of 4


def test_fp32_hook_matches_single_process_losses(runs, baseline):
    assert_same_losses(baseline("plain").losses(), step_losses(runs["fp32"]), rtol=1e-6)


def test_int8_hook_sends_a_quarter_of_the_bytes_and_still_trains(runs):
    fp32 = step_losses(runs["fp32"], "comm/reduce_scatter_bytes")
    int8 = step_losses(runs["int8"], "comm/all_to_all_bytes")
    assert "comm/reduce_scatter_bytes" not in next(runs["int8"].rglob("metrics.csv")).read_text()
    # 1 byte per element + 4 bytes of scale per rank per buffer: 3 buffers x 4 ranks x 4 bytes.
    assert sorted(int8) == sorted(fp32)
    for step in fp32:
        assert int8[step] == fp32[step] / 4 + 3 * 4 * 4
    losses, exact = step_losses(runs["int8"]), step_losses(runs["fp32"])
    assert losses[STEPS - 1] < losses[0] - LEARNED
    assert_same_losses(exact, losses, rtol=0.02)
    assert max(abs(losses[s] - exact[s]) for s in exact) > 1e-4  # the hook is applied (measured: 1e-2 apart)


def test_bf16_hook_stays_within_2_percent_of_fp32(runs):
    exact, bf16 = step_losses(runs["fp32"]), step_losses(runs["bf16_hsdp"])
    assert_same_losses(exact, bf16, rtol=0.02)
    # The hook is applied: not fp32's losses (measured: 5.7e-4 apart at most; fp32 under HSDP is within ~1e-6).
    assert max(abs(bf16[s] - exact[s]) for s in exact) > 1e-5


def test_fp16_hook_trains_within_0_01_percent_of_fp32_and_is_not_fp32(runs):
    """fp16 keeps more mantissa than bf16 (FSDP2 scales before and after the sum so that it cannot overflow): close
    to fp32 (measured: 2.4e-6 relative at most over 20 steps, by hand), but not fp32's losses (measured: 8.6e-6 apart at
    most), which an ignored hook gives exactly (same layout, same reduction order)."""
    exact, fp16 = step_losses(runs["fp32"]), step_losses(runs["fp16"])
    assert_same_losses(exact, fp16, rtol=1e-4)
    assert fp16 != exact


def test_hsdp_replicate_all_reduce_is_in_the_hooks_dtype_and_stays_fp32_under_int8(runs):
    """HSDP [[2, 2]]: each rank reduce-scatters the full gradient over fsdp, then all-reduces its shard (parameters /
    2) over replicate. Under bf16 that all-reduce sends 2 bytes per element, half of fp32's 4; int8 replaces the
    reduce-scatter only (all-to-all over fsdp: 1 byte per element + one fp32 scale per rank per buffer), and its
    replicate all-reduce stays fp32. Each step also all-reduces the logged train_loss (4 bytes)."""
    params = sum(p.numel() for p in reference_model().parameters())
    groups = len(resolve(reference_model()).fsdp_units) + 1  # one buffer per FSDP module: the blocks and the root
    shard = params // 2
    for name in ("bf16_hsdp", "int8_hsdp_3"):
        assert set(step_losses(runs[name], "comm/all_reduce_count").values()) == {groups + 1.0}
    bf16 = step_losses(runs["bf16_hsdp"], "comm/all_reduce_bytes")
    int8 = step_losses(runs["int8_hsdp_3"], "comm/all_reduce_bytes")
    assert set(bf16.values()) == {2.0 * shard + 4}
    assert set(int8.values()) == {4.0 * shard + 4}
    assert set(step_losses(runs["int8_hsdp_3"], "comm/all_to_all_bytes").values()) == {params + groups * 2 * 4.0}
    assert "comm/reduce_scatter_bytes" not in next(runs["int8_hsdp_3"].rglob("metrics.csv")).read_text()
    # Both train: the first steps as fp32's within the hooks' tolerance.
    exact = step_losses(runs["fp32"])
    for name in ("bf16_hsdp", "int8_hsdp_3"):
        losses = step_losses(runs[name])
        assert_same_losses({s: exact[s] for s in range(3)}, {s: losses[s] for s in range(3)}, rtol=0.02)


def test_accumulation_reduces_gradients_once_per_fsdp_module_per_optimizer_step(tmp_path, corpus):
    assert_ok(
        fit(
            "hybrid.yaml",
            tmp_path,
            *common(corpus, tmp_path / "cache", steps=5),
            *FSDP2,
            "--trainer.accumulate_grad_batches=4",
        )
    )
    counts = step_losses(tmp_path, "comm/reduce_scatter_count")
    modules = len(resolve(reference_model()).fsdp_units) + 1  # the blocks and the root
    assert len(counts) == 5 and set(counts.values()) == {float(modules)}


HOOK = """
import torch
from parallelkit.comm import CommHook

class Quarter(CommHook):
    '''A third party's hook: reduce in bf16, under its own name.'''
    name = "thirdparty_bf16"
    reduce_dtype = torch.bfloat16
    bytes_ratio = 0.5
"""


def test_third_party_hook_from_an_entry_point_is_selected_by_name_in_yaml(tmp_path, corpus):
    site = tmp_path / "site"
    install_fake_distribution(
        site, "parallelkit-hook", "pk_hook", HOOK, "[parallelkit.comm_hooks]\nthirdparty_bf16 = pk_hook:Quarter\n"
    )
    config = tmp_path / "hook.yaml"
    config.write_text("trainer:\n  strategy:\n    init_args:\n      comm_precision: thirdparty_bf16\n")
    proc = fit(
        "hybrid.yaml",
        tmp_path / "run",
        *common(corpus, tmp_path / "cache", steps=3),
        *FSDP2,
        f"--config={config}",
        PYTHONPATH=str(site),
    )
    assert_ok(proc)
    params = sum(p.numel() for p in reference_model().parameters())
    assert set(step_losses(tmp_path / "run", "comm/reduce_scatter_bytes").values()) == {2.0 * params}


def test_unknown_hook_lists_the_available_ones(tmp_path):
    proc = fit("hybrid.yaml", tmp_path, "--trainer.strategy.comm_precision=fp7")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "comm_precision='fp7' names no installed comm hook; available: bf16, fp16, fp32, int8" in proc.stderr


def ddp(hook: str) -> list[str]:
    return [
        "--trainer.strategy=parallelkit.DDPStrategy",
        f"--trainer.strategy.comm_precision={hook}",
        "--trainer.strategy.profile_communication=true",
    ]


def test_ddp_hooks_apply_on_cpu_with_the_bytes_they_claim(tmp_path, corpus, baseline, ddp_fp32):
    """fp32 and bf16 on ddp.yaml's 2 processes; the fp32 run is the session's `ddp_fp32` (the same flags as
    `ddp("fp32")`, shared with test_cli.py). The bf16 hook's run also computes in bf16-mixed (Lightning's
    autocast under DDP, whose gradients stay fp32: the hook still halves them): DDP's bf16 run."""
    bf16 = (*ddp("bf16"), "--trainer.precision=bf16-mixed")
    assert_ok(fit("ddp.yaml", tmp_path / "bf16", *common(corpus, tmp_path / "cache")[:-1], *bf16))
    runs = {"fp32": ddp_fp32, "bf16": tmp_path / "bf16"}
    params = sum(p.numel() for p in reference_model().parameters())
    fp32, bf16 = (step_losses(runs[h], "comm/all_reduce_bytes") for h in ("fp32", "bf16"))
    # Each step: every gradient once in DDP's buckets, plus the 4-byte train_loss all-reduce for logging.
    assert set(fp32.values()) == {4.0 * params + 4}
    assert set(bf16.values()) == {2.0 * params + 4}
    assert "comm/barrier_count" not in next(runs["bf16"].rglob("metrics.csv")).read_text()  # as fsdp_tp: no barrier
    assert_same_losses(baseline("plain").losses(), step_losses(runs["fp32"]))
    assert_same_losses(step_losses(runs["fp32"]), step_losses(runs["bf16"]), rtol=0.02)


def test_ddp_refuses_a_hook_without_a_ddp_form(tmp_path):
    proc = fit("ddp.yaml", tmp_path, *ddp("int8"))
    assert proc.returncode == 2 and "comm_precision='int8' has no DDP form" in proc.stderr


@pytest.fixture
def one_process_group(tmp_path):
    """A real (gloo) process group of this process alone, for collectives called directly."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_int8_error_feedback_sends_each_steps_rounding_error_with_the_next_step(one_process_group):
    """The same gradient reduced 8 times: what rounding to int8 dropped at one step is added to the next step's
    gradient before it is quantised, so the next reduction differs, and the sum of what arrived is the sum of what was
    sent within one step's rounding error (the residual still held). Without feedback that error grows 8-fold."""
    grad = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    hook = Int8ReduceScatter()
    arrived = []
    for _ in range(8):
        out = torch.empty_like(grad)
        hook(out, grad.clone(), one_process_group, dist.ReduceOp.SUM)
        arrived.append(out)
    half_step = grad.abs().max() / 127 / 2  # int8 rounding error bound: half the scale (absmax / 127)
    rounding = arrived[0] - grad
    assert 0 < rounding.abs().max() <= half_step * 1.0001
    assert not torch.equal(arrived[1], arrived[0])  # the residual changed the next reduction
    drift = torch.stack(arrived).sum(0) - 8 * grad
    torch.testing.assert_close(drift, -hook.residual, rtol=0, atol=1e-5)  # sent = arrived + what is still held
    assert drift.abs().max() <= half_step * 1.01  # one step's rounding, not eight
    assert drift.norm() < 8 * rounding.norm() / 4  # without feedback: drift = 8 x rounding


def test_a_collective_timeout_prints_each_waiting_ranks_last_collectives(tmp_path, corpus):
    """[[2, 2]] with a 10-second timeout (of collectives: the ranks may take 5 minutes to join): rank 3 stops for 20 s
    as step 3 starts. The other ranks' collectives of step 3 time out (the mesh's groups included: torch gives them
    their own 30-minute default); each prints the collectives it called, with their groups and sizes, up to the one
    it waits in; rank 3 prints none, which is how it stands out. 10 s: far above any collective of these steps on a
    loaded 2-core machine (tens of milliseconds), far below the default; the stop outlasts it by as much again."""
    hang = callback("models.HangAt", rank=3, step=3, seconds=20)
    overrides = (*common(corpus, tmp_path / "cache", steps=6), "--trainer.strategy.timeout=10", hang)
    proc = fit("hybrid.yaml", tmp_path, *overrides)
    assert proc.returncode != 0
    records = {}
    for block in proc.stderr.split("parallelkit: rank ")[1:]:
        rank, text = block.split(":", 1)
        if "a collective timed out" in text.splitlines()[0]:
            records[int(rank)] = [line.strip() for line in text.splitlines()[1:17] if line.startswith("  step ")]
    assert sorted(records) == [0, 1, 2], proc.stderr[-3000:]
    for rank, calls in records.items():
        assert len(calls) == 16 and calls[-1].startswith("step 3: "), calls
        assert any(call.startswith("step 2: reduce_scatter over ranks ") for call in calls), calls
        assert all(f"{rank}" in call.split(" over ranks ")[1].split(",") for call in calls if " over ranks " in call)
