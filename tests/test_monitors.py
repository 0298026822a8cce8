"""The in-run monitors, as a user sees them: figures in the CSV logger's metrics.csv of a 2-process run."""

import json
import struct
from pathlib import Path

import pytest
from conftest import REPO, assert_ok, assert_same_losses, common, fit, step_losses


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


def wandb_records(run_file: Path):
    """The protobuf records of an offline wandb run's `run-*.wandb` file: a 7-byte header, then records in 32 KiB
    blocks, each a 7-byte header (checksum, length, kind: 1 whole, 2 first, 3 middle, 4 last part) and its bytes."""
    from wandb.proto import wandb_internal_pb2

    raw, position, pending = run_file.read_bytes(), 7, b""
    while position + 7 <= len(raw):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a header is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[position : position + 7])
        pending += raw[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def wandb_key(item) -> str:
    return item.key or "/".join(item.nested_key)  # wandb writes one or the other, by version


def test_wandb_offline_run_records_the_loss_and_the_parallel_layout(tmp_path, corpus, baseline):
    """configs/wandb.yaml on top of hybrid.yaml, on a machine with no wandb account and no WANDB_MODE: the run stays
    offline, its history holds the per-step train_loss (one process's, on [[1, 2]]) and its config the layout."""
    mesh = [
        '--trainer.strategy.mesh_shape=[[1, 2], ["fsdp", "tp"]]',
        "--trainer.devices=2",
        "--data.init_args.batch_size=8",
    ]
    wandb = ["--config", str(REPO / "configs" / "wandb.yaml"), f"--trainer.logger.init_args.save_dir={tmp_path}"]
    env = {"WANDB_MODE": "", "WANDB_API_KEY": "", "HOME": str(tmp_path)}  # no account: no key, no ~/.netrc
    assert_ok(fit("hybrid.yaml", tmp_path, *wandb, *common(corpus, tmp_path / "cache", steps=5), *mesh, **env))
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    losses, config = {}, {}
    for record in wandb_records(run_file):
        if record.HasField("history"):
            row = {wandb_key(item): json.loads(item.value_json) for item in record.history.item}
            if "train_loss" in row:
                losses[row["trainer/global_step"]] = row["train_loss"]
        elif record.HasField("config"):
            config.update({wandb_key(item): json.loads(item.value_json) for item in record.config.update})
    # Steps 0-4 are inside the 10-step warmup, whose learning rates do not depend on the run's length.
    expected = {step: loss for step, loss in baseline("plain").losses().items() if step < 5}
    assert_same_losses(expected, losses)
    assert config["parallel"] == {
        "strategy": "FSDPTPStrategy",
        "mesh_shape": '[[1, 2], ["fsdp", "tp"]]',
        "world_size": 2,
        "dp_size": 1,
        "pp_size": 1,
        "replicate_size": 1,
        "fsdp_size": 1,
        "tp_size": 2,
    }
    assert config["n_layer"] == 2  # the model's own hyperparameters next to it
