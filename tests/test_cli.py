import json
from pathlib import Path

import pytest
import torch
from support import LEARNED, REPO, SINGLE_PROCESS, STEPS, assert_ok, assert_same_losses, fit, parallelkit, step_losses


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
        ('[[2, 2], ["fsdp", "mp"]]', ["unknown axis 'mp'", "pp, replicate, fsdp, ep, cp, tp"]),
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


def test_ddp_two_processes_matches_single_process_losses_per_step(tmp_path: Path, corpus: Path, baseline):
    """Lightning's DDP on 2 processes against the session's single-process run with the same validation (every
    `RESUME_AT` steps, 3 batches: support.SINGLE_PROCESS["val"])."""
    common = [
        f"--trainer.max_steps={STEPS}",
        *SINGLE_PROCESS["val"],
        f"--data.init_args.paths={corpus}",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
    ]
    assert_ok(fit("ddp.yaml", tmp_path / "ddp", *common))
    single_run = baseline("val")
    single, ddp = single_run.losses(), step_losses(tmp_path / "ddp")
    assert sorted(single) == sorted(ddp) == list(range(STEPS))
    for step in single:
        assert abs(ddp[step] - single[step]) <= 1e-5 * abs(single[step]), (step, single[step], ddp[step])
    assert single[STEPS - 1] < single[0] - LEARNED  # it learns
    val_single, val_ddp = single_run.losses("val_loss"), step_losses(tmp_path / "ddp", "val_loss")
    assert val_single.keys() == val_ddp.keys() and len(val_single) == 2
    for step in val_single:
        assert abs(val_ddp[step] - val_single[step]) <= 1e-5 * val_single[step]


def evaluate(subcommand: str, config: str, save_dir: Path, corpus: Path, checkpoint: Path, *overrides: str):
    """`parallelkit validate|test|predict --config configs/<config> --ckpt_path=<checkpoint>` on 3 batches of the
    validation split, logging CSV under `save_dir`."""
    stage = {"validate": "val", "test": "test", "predict": "predict"}[subcommand]
    return parallelkit(
        subcommand,
        "--config",
        str(REPO / "configs" / config),
        *overrides,
        f"--ckpt_path={checkpoint}",
        f"--trainer.limit_{stage}_batches=3",
        f"--trainer.logger.init_args.save_dir={save_dir}",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--data.init_args.paths={corpus}",
        f"--data.init_args.cache_dir={save_dir / 'cache'}",
        cwd=save_dir,
    )


def single_process_val_loss(baseline) -> float:
    """One process's val_loss on 3 validation batches after `RESUME_AT` steps: the weights of the shared reference
    runs' checkpoints of that step, which train in parity with it."""
    losses = baseline("val").losses("val_loss")
    return losses[min(losses)]


@pytest.mark.parametrize("config", ["hybrid.yaml", "1f1b.yaml"])
@pytest.mark.parametrize(("subcommand", "key"), [("validate", "val_loss"), ("test", "test_loss")])
def test_validate_and_test_a_checkpoint_give_the_single_process_loss(
    tmp_path: Path, corpus: Path, reference, baseline, config: str, subcommand: str, key: str
):
    """fsdp_tp [[2, 2]] (the model logs the loss) and 1F1B pp=2 (the strategy does) evaluate a checkpoint of their
    own layout to one process's loss on the same batches."""
    assert_ok(evaluate(subcommand, config, tmp_path, corpus, reference(config).checkpoint))
    assert_same_losses({0: single_process_val_loss(baseline)}, step_losses(tmp_path, key))


def test_bf16_true_validation_averages_in_fp32_to_fp32s_val_loss(tmp_path: Path, corpus: Path):
    """Under `precision: bf16-true` the module is cast to bf16, and with it torchmetrics' states unless they guard
    against it: the validation mean was then a bf16 running sum (6.66 for fp32's 5.58 over the whole split; rounded to
    bf16 even over two batches). Every batch of the validation split, on a parallelkit strategy (one process)."""
    val_loss = {}
    for precision in ("32-true", "bf16-true"):
        (tmp_path / precision).mkdir()
        assert_ok(
            parallelkit(
                "validate",
                "--config",
                str(REPO / "configs" / "single.yaml"),
                "--trainer.strategy=fsdp2",
                f"--trainer.precision={precision}",
                "--trainer.limit_val_batches=1.0",
                f"--trainer.logger.init_args.save_dir={tmp_path / precision}",
                "--trainer.enable_progress_bar=false",
                f"--data.init_args.paths={corpus}",
                f"--data.init_args.cache_dir={tmp_path / 'cache'}",
                cwd=tmp_path / precision,
            )
        )
        (val_loss[precision],) = step_losses(tmp_path / precision, "val_loss").values()
    fp32, bf16 = val_loss["32-true"], val_loss["bf16-true"]
    # Each batch's loss computed in bf16 is within a few units of bf16's rounding (2**-8) of fp32's; so is their mean.
    assert abs(bf16 - fp32) < 2**-8 * fp32, val_loss
    assert bf16 != fp32 and float(torch.tensor(bf16).bfloat16()) != bf16, val_loss  # computed in bf16, not summed in it


@pytest.mark.parametrize(("config", "processes", "batch_size"), [("hybrid.yaml", 4, 4), ("1f1b.yaml", 2, 8)])
def test_predict_from_a_checkpoint_returns_every_ranks_logits_for_its_batch(
    tmp_path: Path, corpus: Path, reference, baseline, config: str, processes: int, batch_size: int
):
    """`parallelkit predict` returns, on every rank, the logits of its batch (fsdp_tp: its data-parallel slice; a
    pipeline: the last stage's, on every stage), whose loss against the targets is one process's val_loss."""
    out = tmp_path / "predictions"
    writer = f'--trainer.callbacks+={{"class_path": "models.PredictionLosses", "init_args": {{"out_dir": "{out}"}}}}'
    assert_ok(evaluate("predict", config, tmp_path, corpus, reference(config).checkpoint, writer))
    ranks = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    assert len(ranks) == processes
    batches = [batch for rank in ranks for batch in rank]
    assert len(batches) == 3 * processes and all(batch["shape"] == [batch_size, 64, 256] for batch in batches)
    # Every data-parallel slice of a batch is the same size, and each appears equally often (once per tp rank).
    mean = sum(batch["loss"] for batch in batches) / len(batches)
    assert_same_losses({0: single_process_val_loss(baseline)}, {0: mean})


def test_a_registered_strategy_name_becomes_its_class_only_when_options_follow(tmp_path):
    """`--trainer.strategy NAME` (either spelling, or a config's `strategy: NAME`) with `--trainer.strategy.*` options
    after it: the registry's class and arguments, after "auto" (a previous class's arguments not carried over)."""
    import json

    from parallelkit.cli.lightning_cli import strategy_name_as_class

    option = "--trainer.strategy.microbatches=2"
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  strategy: 1f1b\n")
    for args in (
        ["fit", "--trainer.strategy=1f1b", option],
        ["fit", "--trainer.strategy", "1f1b", option],
        ["fit", "--config", str(config), option],
    ):
        expanded = strategy_name_as_class(args)
        at = expanded.index("--trainer.strategy=auto")
        spec = json.loads(expanded[at + 1].split("=", 1)[1])
        assert spec == {
            "class_path": "parallelkit.strategies.pipeline.PipelineStrategy",
            "init_args": {"schedule": "1f1b"},
        }
        assert expanded[at + 2 :] == [option], expanded
    assert strategy_name_as_class(["fit", "--trainer.strategy=1f1b"]) == ["fit", "--trainer.strategy=1f1b"]


def test_a_finished_distributed_run_ends_each_rank_after_its_atexit_handlers_without_finalising(ddp_fp32):
    """The session's DDP run launched for real (`python -m parallelkit.cli`, Lightning's launcher): each rank ran the
    atexit handlers (where process groups are destroyed and loggers closed) and then ended without the interpreter's
    finalisation, where gloo's worker threads can abort a run that trained and saved everything ("terminate called
    without an active exception", exit -6: once in a full run of the suite, torchrun's relaunch of the checkpoints
    guide). `models.ExitMarks` writes a mark from an atexit handler and one from an audit hook finalisation calls."""
    marks = sorted(p.name for p in (ddp_fp32 / "exit").iterdir())
    assert marks == ["atexit-rank0", "atexit-rank1"], marks
