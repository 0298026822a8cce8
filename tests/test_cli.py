from pathlib import Path

import pytest
from conftest import assert_ok, fit, parallelkit, step_losses


def test_env_lays_out_a_mesh_rank_by_coordinate(tmp_path: Path):
    proc = parallelkit("env", "--mesh", '[[2, 2], ["fsdp", "tp"]]', "--devices", "4", cwd=tmp_path)
    assert_ok(proc)
    assert "torch" in proc.stdout and "gloo: yes" in proc.stdout and "MASTER_ADDR" in proc.stdout
    rows = [line.split("│")[1:-1] for line in proc.stdout.splitlines() if line.count("│") == 6]
    table = [[cell.strip() for cell in row] for row in rows if row[0].strip().isdigit()]
    # rank, node, fsdp, tp, dp rank
    assert table == [
        ["0", "0", "0", "0", "0"],
        ["1", "0", "0", "1", "0"],
        ["2", "0", "1", "0", "1"],
        ["3", "0", "1", "1", "1"],
    ]


@pytest.mark.parametrize(
    ("mesh", "fragments"),
    [
        ('[[2, 3], ["fsdp", "tp"]]', ["fsdp=2 x tp=3 = 6", "world size is 4", '[[2, 2], ["fsdp", "tp"]]']),
        ('[[2, 2], ["fsdp", "fsdp"]]', ["repeats the axis 'fsdp'"]),
        ('[[0, 4], ["fsdp", "tp"]]', ["size 0", "-1"]),
        ('[[2, 2], ["fsdp", "mp"]]', ["unknown axis 'mp'", "pp, replicate, fsdp, tp"]),
    ],
)
def test_bad_mesh_is_one_paragraph_error_without_traceback(tmp_path: Path, mesh: str, fragments: list[str]):
    proc = parallelkit("env", "--mesh", mesh, "--devices", "4", cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    error = proc.stderr.strip()
    assert error.startswith("parallelkit: error: mesh_shape") and "\n" not in error
    for fragment in fragments:
        assert fragment in error


def test_help_lists_lightning_subcommands_and_tools(tmp_path: Path):
    proc = parallelkit("--help", cwd=tmp_path)
    assert_ok(proc)
    for word in ("fit", "validate", "test", "predict", "parallelkit env", "parallelkit plugins"):
        assert word in proc.stdout


def test_ddp_two_processes_matches_single_process_losses_per_step(tmp_path: Path, corpus: Path):
    common = [
        "--trainer.max_steps=20",
        "--trainer.val_check_interval=10",
        "--trainer.limit_val_batches=2",
        f"--data.init_args.paths={corpus}",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
    ]
    assert_ok(fit("single.yaml", tmp_path / "single", *common))
    assert_ok(fit("ddp.yaml", tmp_path / "ddp", *common))
    single, ddp = step_losses(tmp_path / "single"), step_losses(tmp_path / "ddp")
    assert sorted(single) == sorted(ddp) == list(range(20))
    for step in single:
        assert abs(ddp[step] - single[step]) <= 1e-5 * abs(single[step]), (step, single[step], ddp[step])
    assert single[19] < single[0] - 1.0  # it learns
    val_single, val_ddp = step_losses(tmp_path / "single", "val_loss"), step_losses(tmp_path / "ddp", "val_loss")
    assert val_single.keys() == val_ddp.keys() and len(val_single) == 2
    for step in val_single:
        assert abs(val_ddp[step] - val_single[step]) <= 1e-5 * val_single[step]
