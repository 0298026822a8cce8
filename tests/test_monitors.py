"""The in-run monitors, as a user sees them: figures in the CSV logger's metrics.csv of a 2-process run."""

import json
from pathlib import Path

import pytest
from conftest import assert_ok, common, fit, step_losses


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, corpus) -> Path:
    """hybrid.yaml (monitors on) on [[1, 2]]: two tensor-parallel ranks sharing one batch per step."""
    root = tmp_path_factory.mktemp("monitors")
    mesh = ['--trainer.strategy.mesh_shape=[[1, 2], ["fsdp", "tp"]]', "--trainer.devices=2"]
    assert_ok(fit("hybrid.yaml", root, *common(corpus, root / "cache", steps=8), *mesh))
    return root


def test_throughput_counts_replicas_not_processes(tp2):
    samples, device = step_losses(tp2, "train/samples_per_sec"), step_losses(tp2, "train/device/samples_per_sec")
    tokens = step_losses(tp2, "train/items_per_sec")
    assert samples and samples.keys() == tokens.keys()
    for step in samples:
        assert samples[step] == pytest.approx(device[step])  # one replica: the two tp ranks share its batch
        assert tokens[step] == pytest.approx(64 * samples[step])  # seq_len 64
    flops, device_flops = step_losses(tp2, "train/flops_per_sec"), step_losses(tp2, "train/device/flops_per_sec")
    for step in flops:
        assert flops[step] == pytest.approx(2 * device_flops[step])  # each tp rank does half the work


def test_rank_monitor_logs_step_time_straggler_ratio_and_memory(tp2):
    straggler, step_s = step_losses(tp2, "rank/straggler"), step_losses(tp2, "rank/step_s")
    assert sorted(straggler) == list(range(8))
    assert all(ratio >= 1.0 for ratio in straggler.values())
    assert all(step_s[s] <= step_losses(tp2, "rank/step_s_max")[s] for s in step_s)
    peak, state = step_losses(tp2, "memory/peak_mb"), step_losses(tp2, "memory/state_mb")
    activations = step_losses(tp2, "memory/activations_mb")
    for step in peak:
        assert peak[step] == pytest.approx(state[step] + activations[step]) and activations[step] > 0
    assert step_losses(tp2, "memory/rss_peak_mb")[7] > peak[7]  # the process holds more than its tensors


def test_pytorch_profiler_writes_a_trace_per_rank(tmp_path, corpus):
    profiler = [
        "--trainer.profiler=lightning.pytorch.profilers.PyTorchProfiler",
        f"--trainer.profiler.dirpath={tmp_path / 'prof'}",
        "--trainer.profiler.filename=trace",
        "--trainer.profiler.export_to_chrome=true",
    ]
    mesh = ['--trainer.strategy.mesh_shape=[[2, 1], ["fsdp", "tp"]]', "--trainer.devices=2"]
    assert_ok(fit("hybrid.yaml", tmp_path, *common(corpus, tmp_path / "cache", steps=3), *mesh, *profiler))
    for rank in (0, 1):
        (trace,) = (tmp_path / "prof").glob(f"fit-trace-{rank}-*FSDPTPStrategy.training_step*.pt.trace.json")
        events = json.loads(trace.read_text())["traceEvents"]
        assert any("aten::mm" in event.get("name", "") for event in events)  # the model's matmuls are in it
