"""fsdp_tp held to the gold standard: per-step losses equal to one process's, launched as users launch."""

import json
import sys
from pathlib import Path

import pytest
from conftest import REPO, assert_ok, assert_same_losses, common, fit, free_port, run, step_losses, torchrun

STEPS = 20


def layout(mesh: str, devices: int, batch_size: int) -> list[str]:
    return [
        f"--trainer.strategy.mesh_shape={mesh}",
        f"--trainer.devices={devices}",
        f"--data.init_args.batch_size={batch_size}",
    ]


@pytest.fixture(scope="module")
def baselines(baseline):
    """Single-process losses at global batch 8: plain, with accumulation 2, with clipping."""
    losses = {name: baseline(name).losses() for name in ("plain", "accumulate", "clip")}
    # The clipped baseline must differ, or the clipping test below would prove nothing.
    assert any(abs(losses["clip"][s] - losses["plain"][s]) > 1e-4 for s in losses["plain"])
    return losses


@pytest.mark.parametrize(
    ("name", "mesh", "devices", "batch_size", "extra", "expected"),
    [
        ("fsdp4", '[[4, 1], ["fsdp", "tp"]]', 4, 2, [], "plain"),
        ("tp2", '[[1, 2], ["fsdp", "tp"]]', 2, 8, ["--trainer.strategy.loss_parallel=true"], "plain"),
        ("hybrid2x2", '[[2, 2], ["fsdp", "tp"]]', 4, 4, [], "plain"),
        ("fsdp2_accumulate2", '[[2, 1], ["fsdp", "tp"]]', 2, 4, ["--trainer.accumulate_grad_batches=2"], "accumulate"),
        ("hsdp2x2x1", '[[2, 2, 1], ["replicate", "fsdp", "tp"]]', 4, 2, [], "plain"),
        ("hybrid2x2_clip", '[[2, 2], ["fsdp", "tp"]]', 4, 4, ["--trainer.gradient_clip_val=0.05"], "clip"),
        (
            "tp2_no_sp_clip",
            '[[1, 2], ["fsdp", "tp"]]',
            2,
            8,
            ["--trainer.strategy.sequence_parallel=false", "--trainer.gradient_clip_val=0.05"],
            "clip",
        ),
    ],
)
def test_layout_matches_single_process_losses(
    tmp_path, corpus, baselines, name, mesh, devices, batch_size, extra, expected
):
    assert_ok(
        fit("hybrid.yaml", tmp_path, *common(corpus, tmp_path / "cache"), *layout(mesh, devices, batch_size), *extra)
    )
    losses = step_losses(tmp_path)
    assert_same_losses(baselines[expected], losses)
    assert losses[STEPS - 1] < losses[0] - 1.0


def test_hybrid_trains_in_bf16_mixed_close_to_fp32(tmp_path, corpus, baselines):
    assert_ok(fit("hybrid.yaml", tmp_path, *common(corpus, tmp_path / "cache"), "--trainer.precision=bf16-mixed"))
    assert_same_losses(baselines["plain"], step_losses(tmp_path), rtol=0.02)


def test_user_model_with_its_own_plan_matches_single_process_on_2x2(tmp_path, corpus):
    model = ["--model=models.TinyMixer", *common(corpus, tmp_path / "cache")]
    assert_ok(fit("single.yaml", tmp_path / "single", *model))
    assert_ok(fit("hybrid.yaml", tmp_path / "hybrid", *model))
    single, hybrid = step_losses(tmp_path / "single"), step_losses(tmp_path / "hybrid")
    assert_same_losses(single, hybrid)
    assert hybrid[STEPS - 1] < hybrid[0]


def test_fsdp4_holds_under_a_third_of_the_single_process_training_state(tmp_path, corpus):
    def measure(config: str, out: Path, *extra: str) -> list[int]:
        callback = f'--trainer.callbacks+={{"class_path": "models.StateBytes", "init_args": {{"out_dir": "{out}"}}}}'
        assert_ok(fit(config, out, *common(corpus, tmp_path / "cache"), "--trainer.max_steps=2", callback, *extra))
        return [json.loads(p.read_text())["bytes"] for p in sorted(out.glob("rank*.json"))]

    (single,) = measure("single.yaml", tmp_path / "single")
    sharded = measure("hybrid.yaml", tmp_path / "fsdp4", *layout('[[4, 1], ["fsdp", "tp"]]', 4, 2))
    assert len(sharded) == 4
    assert max(sharded) <= 0.3 * single, (single, sharded)


def test_meta_init_never_holds_the_whole_model_and_equals_the_eager_weights(tmp_path):
    """`meta_init` on a 2 x 2 mesh: parameters stay on the meta device until setup; each process's peak memory
    grows by well under one model (an eager build grows by more than one); gathered weights equal an eager
    build's from the same seed exactly. (The parity tests above run hybrid.yaml, which sets meta_init too.)"""
    mesh = '[[2, 2], ["fsdp", "tp"]]'
    found = {}
    for mode in ("meta", "eager"):
        assert_ok(torchrun("meta_init.py", 4, mesh, str(tmp_path / f"{mode}.json"), mode, cwd=tmp_path))
        found[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
    meta, eager = found["meta"], found["eager"]
    assert meta["meta_until_setup"] and not eager["meta_until_setup"]
    assert meta["max_abs_diff"] == 0.0 and eager["max_abs_diff"] == 0.0
    model = meta["model_bytes"]
    assert eager["growth"] >= model, found  # the measure sees a whole model when there is one
    assert meta["growth"] <= 0.75 * model, found  # a quarter is the shards; the rest allocator slack


def test_meta_init_refuses_a_model_it_cannot_initialise(tmp_path):
    proc = fit(
        "hybrid.yaml",
        tmp_path,
        "--model=models.UninitialisableMixer",
        "--trainer.devices=1",
        '--trainer.strategy.mesh_shape=[[1], ["fsdp"]]',
        "--trainer.max_steps=1",
    )
    assert proc.returncode != 0
    assert "gain (Gain) hold parameters or buffers and have no reset_parameters()" in proc.stderr, proc.stderr[-3000:]
    assert "meta_init=False" in proc.stderr


def test_hsdp_on_two_torchrun_nodes_matches_single_process(tmp_path, corpus):
    """Two launchers on this machine act as two nodes of 2 processes, as a cluster would start them."""
    port = free_port()
    args = [
        "fit",
        "--config",
        str(REPO / "configs" / "hsdp.yaml"),
        *common(corpus, tmp_path / "cache"),
        f"--trainer.logger.init_args.save_dir={tmp_path / 'hsdp'}",
        "--trainer.enable_progress_bar=false",
        "--trainer.num_nodes=2",
        "--trainer.devices=2",
    ]
    import subprocess

    from conftest import subprocess_env

    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=2",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "-m",
                "parallelkit.cli",
                *args,
            ],
            cwd=tmp_path,
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-4000:] + outputs[1][-4000:]
    assert_ok(fit("single.yaml", tmp_path / "single", *common(corpus, tmp_path / "cache")))
    assert_same_losses(step_losses(tmp_path / "single"), step_losses(tmp_path / "hsdp"))


def test_bad_mesh_fails_before_launch_with_the_arithmetic(tmp_path):
    proc = fit("hybrid.yaml", tmp_path, "--trainer.strategy.mesh_shape=[[2, 3], [fsdp, tp]]")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "fsdp=2 x tp=3 = 6 processes" in proc.stderr and "world size is 4" in proc.stderr


def test_python_api_by_registered_name(tmp_path):
    code = (
        "import lightning as L, parallelkit\n"
        "t = L.Trainer(strategy='fsdp_tp', accelerator='cpu', devices=4, logger=False)\n"
        "print(type(t.strategy).__name__, t.strategy.mesh_spec)\n"
        "t = L.Trainer(strategy='hsdp', accelerator='cpu', devices=2, num_nodes=2, logger=False)\n"
        "print(type(t.strategy).__name__, t.strategy.mesh_spec)\n"
    )
    proc = run([sys.executable, "-c", code], tmp_path)
    assert_ok(proc)
    assert 'FSDPTPStrategy [[4, 1], ["fsdp", "tp"]]' in proc.stdout
    assert 'HSDPStrategy [[2, 2, 1], ["replicate", "fsdp", "tp"]]' in proc.stdout


def test_optimizer_from_the_command_line_steps_the_sharded_parameters(tmp_path, corpus):
    """LightningCLI builds `--optimizer` before the strategy shards the model; it must still train the shards."""
    sgd = [*common(corpus, tmp_path / "cache", steps=6), "--optimizer=torch.optim.SGD", "--optimizer.lr=0.1"]
    assert_ok(fit("single.yaml", tmp_path / "single", *sgd))
    assert_ok(fit("hybrid.yaml", tmp_path / "hybrid", *sgd))
    assert_same_losses(step_losses(tmp_path / "single"), step_losses(tmp_path / "hybrid"))


def test_auto_mesh_takes_the_planners_layout_and_keeps_parity(tmp_path, corpus):
    proc = fit(
        "hybrid.yaml",
        tmp_path / "auto",
        *common(corpus, tmp_path / "cache", steps=6),
        "--trainer.strategy.mesh_shape=auto",
    )
    assert_ok(proc)
    line = next(line for line in (proc.stdout + proc.stderr).splitlines() if "mesh_shape='auto' -> " in line)
    mesh = json.loads(line.split("-> ", 1)[1].split(":", 1)[0])
    assert "highest estimated throughput" in line
    dp = 1
    for size, axis in zip(*mesh):
        dp *= size if axis in ("replicate", "fsdp") else 1
    # The same global batch in one process: hybrid.yaml's 4 per data-parallel rank.
    single = fit(
        "single.yaml",
        tmp_path / "single",
        *common(corpus, tmp_path / "cache", steps=6),
        f"--data.init_args.batch_size={4 * dp}",
    )
    assert_ok(single)
    assert_same_losses(step_losses(tmp_path / "single"), step_losses(tmp_path / "auto"))
