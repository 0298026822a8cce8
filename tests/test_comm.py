"""Communication-precision hooks, held to the bytes they claim (measured by the profiler) and to the losses."""

import pytest
from conftest import assert_ok, assert_same_losses, fit, step_losses
from conftest import common as run_args
from test_plugins import install_fake_distribution

from parallelkit.models import GPT
from parallelkit.plan import fsdp_units

FSDP4 = [
    '--trainer.strategy.mesh_shape=[[4, 1], ["fsdp", "tp"]]',
    "--trainer.devices=4",
    "--data.init_args.batch_size=2",
]


def common(corpus, cache, steps: int = 20) -> list[str]:
    return [*run_args(corpus, cache, steps), "--trainer.strategy.profile_communication=true"]


def reference_model() -> GPT:
    return GPT(n_layer=2, n_head=4, n_embd=64)  # configs' model: every dim divisible by 4, so FSDP adds no padding


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """[[4, 1]] runs under each built-in hook for 20 steps, and fp32 and bf16 for 50 (bf16 held to fp32 longer)."""
    root = tmp_path_factory.mktemp("comm")
    for hook, steps in (("fp32", 20), ("fp16", 20), ("int8", 20), ("fp32", 50), ("bf16", 50)):
        assert_ok(
            fit(
                "hybrid.yaml",
                root / f"{hook}_{steps}",
                *common(corpus, root / "cache", steps),
                *FSDP4,
                f"--trainer.strategy.comm_precision={hook}",
            )
        )
    return root


def test_fp32_gradient_bytes_equal_four_bytes_per_parameter_per_step(runs):
    params = sum(p.numel() for p in reference_model().parameters())
    per_step = step_losses(runs / "fp32_20", "comm/reduce_scatter_bytes")
    assert len(per_step) == 20
    # One reduce-scatter of every (unsharded, fp32) gradient per optimizer step.
    assert set(per_step.values()) == {4.0 * params}


@pytest.mark.parametrize(("half", "full"), [("bf16_50", "fp32_50"), ("fp16_20", "fp32_20")])
def test_half_precision_hooks_halve_gradient_bytes(runs, half, full):
    full_bytes = step_losses(runs / full, "comm/reduce_scatter_bytes")
    half_bytes = step_losses(runs / half, "comm/reduce_scatter_bytes")
    assert sorted(half_bytes) == sorted(full_bytes)
    for step in full_bytes:
        assert half_bytes[step] / full_bytes[step] == pytest.approx(0.5, rel=0.01)


def test_fp32_hook_matches_single_process_losses(runs, baseline):
    assert_same_losses(baseline("plain").losses(), step_losses(runs / "fp32_20"), rtol=1e-6)


def test_int8_hook_sends_a_quarter_of_the_bytes_and_still_trains(runs):
    fp32 = step_losses(runs / "fp32_20", "comm/reduce_scatter_bytes")
    int8 = step_losses(runs / "int8_20", "comm/all_to_all_bytes")
    assert "comm/reduce_scatter_bytes" not in next((runs / "int8_20").rglob("metrics.csv")).read_text()
    # 1 byte per element + 4 bytes of scale per rank per buffer: 3 buffers x 4 ranks x 4 bytes.
    assert sorted(int8) == sorted(fp32)
    for step in fp32:
        assert int8[step] == fp32[step] / 4 + 3 * 4 * 4
    losses = step_losses(runs / "int8_20")
    assert losses[19] < losses[0] - 1.0
    assert_same_losses(step_losses(runs / "fp32_20"), losses, rtol=0.02)


def test_bf16_hook_stays_within_2_percent_of_fp32_over_50_steps(runs):
    assert_same_losses(step_losses(runs / "fp32_50"), step_losses(runs / "bf16_50"), rtol=0.02)


def test_accumulation_reduces_gradients_once_per_fsdp_module_per_optimizer_step(tmp_path, corpus):
    assert_ok(
        fit(
            "hybrid.yaml",
            tmp_path,
            *common(corpus, tmp_path / "cache", steps=5),
            *FSDP4,
            "--trainer.accumulate_grad_batches=4",
        )
    )
    counts = step_losses(tmp_path, "comm/reduce_scatter_count")
    modules = len(fsdp_units(reference_model())) + 1  # the blocks and the root
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
        *FSDP4,
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


def test_ddp_hooks_apply_on_cpu_with_the_bytes_they_claim(tmp_path, corpus, baseline):
    for hook in ("fp32", "bf16"):
        assert_ok(fit("ddp.yaml", tmp_path / hook, *common(corpus, tmp_path / "cache")[:-1], *ddp(hook)))
    params = sum(p.numel() for p in reference_model().parameters())
    fp32, bf16 = (step_losses(tmp_path / h, "comm/all_reduce_bytes") for h in ("fp32", "bf16"))
    # Each step: every gradient once in DDP's buckets, plus the 4-byte train_loss all-reduce for logging.
    assert set(fp32.values()) == {4.0 * params + 4}
    assert set(bf16.values()) == {2.0 * params + 4}
    assert_same_losses(baseline("plain").losses(), step_losses(tmp_path / "fp32"))
    assert_same_losses(step_losses(tmp_path / "fp32"), step_losses(tmp_path / "bf16"), rtol=0.02)


def test_ddp_refuses_a_hook_without_a_ddp_form(tmp_path):
    proc = fit("ddp.yaml", tmp_path, *ddp("int8"))
    assert proc.returncode == 2 and "comm_precision='int8' has no DDP form" in proc.stderr
