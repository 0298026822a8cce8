"""The in-run monitors, as a user sees them: figures in the CSV logger's metrics.csv of a 2-process run."""

import json
import statistics
import struct
from pathlib import Path

import pytest
import torch
from snippets import parallelkit_args
from support import assert_ok, assert_same_losses, common, fit, fit_command, step_losses

# The configs' model (configs/hybrid.yaml) and batch, for the hand counts below.
N_LAYER, N_EMBD, VOCAB, MLP_RATIO, SEQ_LEN, BATCH = 2, 64, 256, 4, 64, 4
STEPS, WINDOW = 8, 5  # ThroughputMonitor's rates need a full window of 5 steps: they appear from step 4
SLOW_RANK_S = 0.25


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, corpus) -> Path:
    """hybrid.yaml (monitors on) on [[1, 2]]: two tensor-parallel ranks sharing one batch per step."""
    root = tmp_path_factory.mktemp("monitors")
    mesh = ['--trainer.strategy.mesh_shape=[[1, 2], ["fsdp", "tp"]]', "--trainer.devices=2"]
    assert_ok(fit("hybrid.yaml", root, *common(corpus, root / "cache", steps=STEPS), *mesh))
    return root


@pytest.fixture(scope="module")
def dp2(tmp_path_factory, corpus) -> Path:
    """hybrid.yaml on [[2, 1]]: two data-parallel replicas, each with its own batch. Rank 1 is made a straggler
    (it sleeps SLOW_RANK_S in every step, after the step's last collective), and torch's profiler is on: the
    monitoring guide's profiler command (its traces under `prof/` of the run's directory)."""
    root = tmp_path_factory.mktemp("monitors_dp2")
    mesh = ['--trainer.strategy.mesh_shape=[[2, 1], ["fsdp", "tp"]]', "--trainer.devices=2"]
    slow = (
        '--trainer.callbacks+={"class_path": "monitor_callbacks.SlowRank", '
        f'"init_args": {{"rank": 1, "seconds": {SLOW_RANK_S}}}}}'
    )
    profiled = parallelkit_args("profiler")
    assert_ok(fit_command(profiled, root, *common(corpus, root / "cache", steps=STEPS), *mesh, slow))
    return root


EVERY_STEP = [
    "train_loss",
    "train/time",
    "train/samples",
    "rank/step_s",
    "rank/step_s_max",
    "rank/straggler",
    "memory/peak_mb",
    "memory/state_mb",
    "memory/activations_mb",
    "memory/rss_peak_mb",
]
RATES = [
    "train/samples_per_sec",
    "train/items_per_sec",
    "train/flops_per_sec",
    "train/device/samples_per_sec",
    "train/device/items_per_sec",
    "train/device/flops_per_sec",
]


@pytest.mark.parametrize("run", ["tp2", "dp2"])
def test_every_monitor_metric_is_logged_at_every_step(request, run):
    metrics = request.getfixturevalue(run)
    for key in EVERY_STEP:
        assert sorted(step_losses(metrics, key)) == list(range(STEPS)), key
    for key in RATES:
        assert sorted(step_losses(metrics, key)) == list(range(WINDOW - 1, STEPS)), key


def flops_per_sample() -> int:
    """The reference GPT's training FLOPs per sample, by hand (PaLM's accounting): 6 per weight of every matrix
    multiply (blocks: q, k, v, proj = 4 d^2, up and down = 2 x 4 d^2; the head V d; the embedding is a lookup) per
    token, plus 12 x d x seq_len per block per token for attention."""
    matmul = N_LAYER * (4 + 2 * MLP_RATIO) * N_EMBD**2 + VOCAB * N_EMBD
    return (6 * matmul + 12 * N_LAYER * N_EMBD * SEQ_LEN) * SEQ_LEN


@pytest.mark.parametrize(("run", "dp"), [("tp2", 1), ("dp2", 2)])
def test_throughput_is_the_jobs_global_batch_over_the_step_time(request, run, dp):
    """Job-wide samples/s = global batch (BATCH per replica x dp replicas; tp ranks share theirs) per second of the
    logged clock; = dp x one replica's; tokens = seq_len x samples; FLOPs = the whole model's per sample, whatever
    the layout, and each of the 2 processes does half of them."""
    metrics = request.getfixturevalue(run)
    clock = step_losses(metrics, "train/time")
    samples = step_losses(metrics, "train/samples_per_sec")
    device = step_losses(metrics, "train/device/samples_per_sec")
    tokens, flops = step_losses(metrics, "train/items_per_sec"), step_losses(metrics, "train/flops_per_sec")
    device_flops = step_losses(metrics, "train/device/flops_per_sec")
    assert sorted(samples) == list(range(WINDOW - 1, STEPS))
    for step in samples:
        elapsed = clock[step] - clock[step - (WINDOW - 1)]
        assert samples[step] == pytest.approx(BATCH * dp * (WINDOW - 1) / elapsed, rel=1e-9)
        assert samples[step] == dp * device[step]
        assert tokens[step] == pytest.approx(SEQ_LEN * samples[step], rel=1e-12)
        assert flops[step] == pytest.approx(flops_per_sample() * samples[step], rel=1e-12)
        assert flops[step] == 2 * device_flops[step]


def state_bytes(fsdp: int, tp: int) -> int:
    """Parameters + gradients + AdamW's two moments, fp32, as one rank holds them: tp shards every matrix (the
    embedding and head by vocabulary) and replicates the 2 norms per block and the final one; fsdp then splits
    what is left evenly (every dimension here is divisible by 2, so FSDP2 adds no padding)."""
    matrices = N_LAYER * (4 + 2 * MLP_RATIO) * N_EMBD**2 + 2 * VOCAB * N_EMBD
    norms = (2 * N_LAYER + 1) * N_EMBD
    local, remainder = divmod(matrices // tp + norms, fsdp)
    assert remainder == 0 and matrices % tp == 0
    return 4 * 4 * local


@pytest.mark.parametrize(("run", "fsdp", "tp"), [("tp2", 1, 2), ("dp2", 2, 1)])
def test_state_memory_is_the_local_shards_of_parameters_gradients_and_adamw_moments(request, run, fsdp, tp):
    metrics = request.getfixturevalue(run)
    expected = state_bytes(fsdp, tp) / 2**20  # a multiple of 1/2048 MB: exact in the logged float32
    state = step_losses(metrics, "memory/state_mb")
    assert sorted(state) == list(range(STEPS)) and set(state.values()) == {expected}
    peak, activations = step_losses(metrics, "memory/peak_mb"), step_losses(metrics, "memory/activations_mb")
    for step in peak:
        assert peak[step] == pytest.approx(state[step] + activations[step], rel=1e-6) and activations[step] > 0
    assert step_losses(metrics, "memory/rss_peak_mb")[STEPS - 1] > peak[STEPS - 1]  # Python and libraries too


def test_rank_monitor_gathers_every_ranks_step_time_and_names_the_straggler(dp2):
    """Rank 1 sleeps SLOW_RANK_S per step; rank 0, which logs, does not: the slowest time logged is rank 1's, the
    median of 2 ranks is their mean, and the straggler ratio is slowest / median."""
    straggler, step_s = step_losses(dp2, "rank/straggler"), step_losses(dp2, "rank/step_s")
    slowest = step_losses(dp2, "rank/step_s_max")
    assert sorted(straggler) == sorted(step_s) == sorted(slowest) == list(range(STEPS))
    for step in straggler:
        assert slowest[step] >= SLOW_RANK_S
        assert straggler[step] == pytest.approx(slowest[step] / step_s[step], rel=1e-6)
    # The median is not the slow rank's time: about SLOW_RANK_S / 2 below it (over the steps, for a loaded machine).
    assert statistics.median(slowest[s] - step_s[s] for s in step_s) > SLOW_RANK_S / 4


def test_pytorch_profiler_writes_a_trace_per_rank(dp2):
    for rank in (0, 1):
        (trace,) = (dp2 / "prof").glob(f"fit-trace-{rank}-*FSDPTPStrategy.training_step*.pt.trace.json")
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
    wandb = parallelkit_args("wandb")  # the monitoring guide's command
    env = {"WANDB_MODE": "", "WANDB_API_KEY": "", "HOME": str(tmp_path)}  # no account: no key, no ~/.netrc
    save_dir = f"--trainer.logger.init_args.save_dir={tmp_path}"  # wandb.yaml's logger's
    assert_ok(fit_command(wandb, tmp_path, save_dir, *common(corpus, tmp_path / "cache", steps=5), *mesh, **env))
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
        "ep_size": 1,
        "cp_size": 1,
        "tp_size": 2,
    }
    assert config["n_layer"] == 2  # the model's own hyperparameters next to it


def test_activation_windows_open_at_once_each_count_the_whole_step():
    """RankMonitor and ActivationMemoryMonitor both watch every step; autograd calls only the innermost saved-tensor
    hooks, so a window of its own for each would leave the first one counting nothing."""
    from parallelkit.callbacks.activations import SavedTensorWindow

    def step() -> torch.Tensor:
        return torch.randn(4, 8, requires_grad=True).exp().sum()  # exp saves its 4 x 8 fp32 output

    alone = SavedTensorWindow()
    alone.start()
    loss = step()
    assert alone.stop() == 128
    first, second = SavedTensorWindow(), SavedTensorWindow()
    first.start()
    second.start()
    loss = step()
    assert second.stop() == first.stop() == 128
    loss.backward()
