"""Pipeline strategies: per-step losses equal one process's, validation too, and errors instead of hangs."""

import pytest
import torch
from snippets import parallelkit_args
from support import (
    LEARNED,
    RESUME_AT,
    STEPS,
    assert_ok,
    assert_same_losses,
    callback,
    common,
    fit,
    fit_command,
    script,
    step_losses,
)
from torch import nn

from parallelkit import PipelineStrategy
from parallelkit.errors import ConfigError, PlanError
from parallelkit.models import GPT
from parallelkit.parallel import resolve
from parallelkit.parallel.pipeline import StageModule
from parallelkit.parallel.resolve import split_stages


@pytest.mark.parametrize(
    ("name", "config", "extra", "expected"),
    [
        ("gpipe_pp2_m4", "gpipe.yaml", [], "plain"),
        # 1F1B pp=2 m=4 as configured is the shared reference run: held to parity in the activation test below.
        ("1f1b_pp2_accumulate2", "1f1b.yaml", ["--trainer.accumulate_grad_batches=2"], "accumulate"),
        (
            "1f1b_pp4_m8",
            "1f1b.yaml",
            ["--trainer.devices=4", '--trainer.strategy.mesh_shape=[[4], ["pp"]]', "--trainer.strategy.microbatches=8"],
            "plain",
        ),
        ("interleaved_pp2_v2", "interleaved.yaml", [], "plain"),
        ("looped_bfs_pp2_v2", "interleaved.yaml", ["--trainer.strategy.schedule=looped_bfs"], "plain"),
        ("3d_pp2_fsdp1_tp2", "3d.yaml", [], "plain"),
        (
            "pp2_fsdp2",
            "1f1b.yaml",
            [
                "--trainer.devices=4",
                '--trainer.strategy.mesh_shape=[[2, 2], ["pp", "fsdp"]]',
                "--data.init_args.batch_size=4",
                "--trainer.strategy.microbatches=2",
            ],
            "plain",
        ),
        # Each sequence split over 2 cp ranks in every stage (the stages hand on their slice and its positions),
        # validating on its pipelined slices too; compiled blocks (aot_eager), the attention eager between graphs.
        (
            "1f1b_pp2_cp2_compiled_validating",
            "1f1b.yaml",
            [
                "--trainer.devices=4",
                '--trainer.strategy.mesh_shape=[[2, 2], ["pp", "cp"]]',
                "--trainer.strategy.compile=aot_eager",
                callback("models.CompiledGraphs"),
                f"--trainer.val_check_interval={RESUME_AT}",
                "--trainer.limit_val_batches=3",
            ],
            "val",
        ),
        # Zero-bubble schedules split each backward into input- and weight-gradient steps. ZB-V and DualPipeV place
        # stages in a V (rank 0 holds stages 0 and 3); ZB-V also validates (torch's eval() fails at the turn of a V
        # unless the strategy's stages step in), DualPipeV on 3D runs under tp with loss parallelism.
        (
            "interleaved_zero_bubble_pp2_v2",
            "interleaved.yaml",
            ["--trainer.strategy.schedule=interleaved_zero_bubble"],
            "plain",
        ),
        (
            "zbv_pp2_validating",
            "interleaved.yaml",
            [
                "--trainer.strategy.schedule=zbv",
                f"--trainer.val_check_interval={RESUME_AT}",
                "--trainer.limit_val_batches=3",
            ],
            "val",
        ),
        (
            "dualpipev_3d_pp2_fsdp1_tp2_loss_parallel",
            "3d.yaml",
            ["--trainer.strategy.schedule=dualpipev", "--trainer.strategy.loss_parallel=true"],
            "plain",
        ),
    ],
)
def test_pipeline_matches_single_process_losses(tmp_path, corpus, baseline, name, config, extra, expected):
    # Interleaved 1F1B through `python -m parallelkit.cli` and Lightning's own launcher: the production path, once
    # for the pipeline family (the others are forked: tests/README.md).
    real_launch = name == "interleaved_pp2_v2"
    assert_ok(fit(config, tmp_path, *common(corpus, tmp_path / "cache"), *extra, real_launch=real_launch))
    losses = step_losses(tmp_path)
    assert_same_losses(baseline(expected).losses(), losses)
    assert losses[STEPS - 1] < losses[0] - LEARNED
    if expected == "val":
        assert_same_losses(baseline(expected).losses("val_loss"), step_losses(tmp_path, "val_loss"))
    if "compiled" in name:
        assert min(step_losses(tmp_path, "compiled_graphs").values()) > 0


def test_pipeline_clipping_uses_the_norm_across_stages_and_shards(tmp_path, corpus, baseline):
    assert_ok(fit("3d.yaml", tmp_path, *common(corpus, tmp_path / "cache"), "--trainer.gradient_clip_val=0.05"))
    clipped = baseline("clip").losses()
    assert any(abs(clipped[s] - baseline("plain").losses()[s]) > 1e-4 for s in clipped)  # clipping bites
    assert_same_losses(clipped, step_losses(tmp_path))


def test_3d_trains_in_bf16_mixed_close_to_fp32(tmp_path, corpus, baseline):
    assert_ok(fit("3d.yaml", tmp_path, *common(corpus, tmp_path / "cache"), "--trainer.precision=bf16-mixed"))
    fp32, bf16 = baseline("plain").losses(), step_losses(tmp_path)
    assert_same_losses(fp32, bf16, rtol=0.02)
    # And not fp32 under another name: fp32 layouts stay within 2e-7 of one process, bf16 moved up to 4e-4.
    assert max(abs(bf16[s] - fp32[s]) / fp32[s] for s in fp32) > 1e-4


def test_every_nth_activation_checkpointing_keeps_1f1b_losses_and_recomputes_each_stages_blocks(
    tmp_path, corpus, baseline, reference
):
    """activation_checkpointing=2 under 1F1B pp=2 (n from the command line is an int): per-step losses equal one
    process's, and the activations saved for backward (RankMonitor's memory/activations_mb, on in every config:
    largest rank) fall below half of the same layout's without it, the shared reference run of 1f1b.yaml. The
    policy counts blocks within each stage: with one block per stage, n=2 recomputes both. Which blocks n picks is
    pinned in test_fsdp_tp.py."""
    plain = reference("1f1b.yaml")
    assert_same_losses(baseline("plain").losses(), plain.losses())
    checkpointing = "--trainer.strategy.activation_checkpointing=2"
    assert_ok(fit("1f1b.yaml", tmp_path, *common(corpus, tmp_path / "cache"), checkpointing))
    assert_same_losses(baseline("plain").losses(), step_losses(tmp_path))
    off = max(plain.losses("memory/activations_mb").values())
    on = max(step_losses(tmp_path, "memory/activations_mb").values())
    assert on < 0.5 * off, (on, off)  # measured 0.22 MB against 1.50 MB


def test_accumulation_reduces_each_stages_gradients_once_per_optimizer_step(tmp_path, corpus, baseline):
    """ZB-V on pp=2 x fsdp=2 with accumulate_grad_batches=2: the stages' reduce-scatters run on the last micro-step
    only (torch's schedules would run them after every micro-step: 4 per optimizer step on rank 0, measured before
    the strategy held them back), and the losses are one process's with the same accumulation."""
    assert_ok(
        fit(
            "interleaved.yaml",
            tmp_path,
            *common(corpus, tmp_path / "cache"),
            "--trainer.strategy.schedule=zbv",
            "--trainer.devices=4",
            '--trainer.strategy.mesh_shape=[[2, 2], ["pp", "fsdp"]]',
            "--data.init_args.batch_size=4",
            "--trainer.accumulate_grad_batches=2",
            "--trainer.strategy.profile_communication=true",
        )
    )
    model = GPT(n_layer=2, n_head=4, n_embd=64)  # the config's model
    stages = resolve(model, num_stages=4).stages
    # Rank 0 holds the V's ends, stages 0 and 3: two FSDP roots and no block (a unit of its own), one reduce-scatter
    # each, of its unsharded fp32 gradients.
    assert (stages[0], stages[3]) == (["tok_emb"], ["norm", "head"])
    held = sum(p.numel() for name in ("tok_emb", "norm", "head") for p in model.get_submodule(name).parameters())
    assert set(step_losses(tmp_path, "comm/reduce_scatter_count").values()) == {2.0}
    assert set(step_losses(tmp_path, "comm/reduce_scatter_bytes").values()) == {4.0 * held}
    assert_same_losses(baseline("accumulate").losses(), step_losses(tmp_path))


def test_zero_bubble_schedules_refuse_what_they_cannot_run():
    """Before any process starts: torch's checkpoint cannot recompute a block in both halves of a split backward,
    nor can compiled code run them, and V-shaped schedules hold exactly 2 stages per rank."""
    with pytest.raises(ConfigError, match="schedule='zbv' with activation_checkpointing='full'.*recomputed twice"):
        PipelineStrategy(schedule="zbv", activation_checkpointing="full").check_options()
    with pytest.raises(ConfigError, match="schedule='interleaved_zero_bubble' with activation_checkpointing=2"):
        PipelineStrategy(schedule="interleaved_zero_bubble", activation_checkpointing=2).check_options()
    with pytest.raises(ConfigError, match="stages_per_rank=3 with schedule='dualpipev'.*exactly 2 stages per rank"):
        PipelineStrategy(schedule="dualpipev", stages_per_rank=3).check_options()
    with pytest.raises(ConfigError, match="schedule='dualpipev' with compile=True.*compile=false"):
        PipelineStrategy(schedule="dualpipev", compile=True).check_options()
    PipelineStrategy(schedule="interleaved_zero_bubble", stages_per_rank=3).check_options()
    PipelineStrategy(schedule="interleaved_1f1b", compile=True).check_options()


def test_pipelined_validation_gives_the_single_process_val_loss(tmp_path, corpus, baseline):
    val = [f"--trainer.val_check_interval={RESUME_AT}", "--trainer.limit_val_batches=3"]
    assert_ok(fit("1f1b.yaml", tmp_path, *common(corpus, tmp_path / "cache"), *val))
    expected = baseline("val").losses("val_loss")
    assert len(expected) == 2
    assert_same_losses(expected, step_losses(tmp_path, "val_loss"))
    assert_same_losses(baseline("val").losses(), step_losses(tmp_path))


def test_1f1b_holds_fewer_activations_than_gpipe_at_pp2_m8(tmp_path, corpus):
    """The pipelines guide's two commands."""
    peaks = {}
    for index, schedule in enumerate(("gpipe", "1f1b")):
        args = parallelkit_args("gpipe-vs-1f1b", index)
        assert f"configs/{schedule}.yaml" in args
        assert_ok(fit_command(args, tmp_path / schedule, *common(corpus, tmp_path / "cache"), "--trainer.max_steps=3"))
        peaks[schedule] = max(step_losses(tmp_path / schedule, "activation_peak_mb").values())
    # Stage 0 keeps all 8 microbatches' activations under GPipe, at most pp=2 in flight under 1F1B.
    assert peaks["1f1b"] < 0.5 * peaks["gpipe"], peaks


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--trainer.strategy.schedule=zigzag"], "schedule='zigzag' is not a pipeline schedule"),
        (["--model=models.TinyMixer"], "needs TinyMixer.pipeline_layers"),
        (["--trainer.strategy.microbatches=1"], "microbatches=1 is fewer than the 2 pipeline ranks"),
    ],
)
def test_bad_pipeline_setup_fails_with_a_clear_error(tmp_path, corpus, extra, message):
    """Microbatches not dividing the batch and more stages than layers are test_errors.py's (AFTER_LAUNCH), with
    the one-paragraph checks; test_split_errors_name_the_numbers holds the stage arithmetic."""
    proc = fit("1f1b.yaml", tmp_path, *common(corpus, tmp_path / "cache"), *extra, timeout=300)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-3000:]


def test_stages_are_balanced_by_parameters_and_keep_names():
    model = GPT(n_layer=4, n_head=2, n_embd=16)
    layers = resolve(model).pipeline_layers
    assert layers == ["tok_emb", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"]
    stages = split_stages(model, layers, 2)
    # 4096 (embedding) + 2 x 3104 (blocks) = 10304 against 2 x 3104 + 16 + 4096 (head) = 10320
    assert stages == [["tok_emb", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "norm", "head"]]
    assert split_stages(model, layers, 2, split_points=["blocks.3"])[1][0] == "blocks.3"
    stage = StageModule(model, stages[1], resolve(model).plan)
    kept = ("blocks.2.", "blocks.3.", "norm.", "head.")
    assert set(stage.state_dict()) == {k for k in model.state_dict() if k.startswith(kept)}
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(stage(x), model.head(model.norm(model.blocks[3](model.blocks[2](x)))))


def test_split_errors_name_the_numbers():
    model = GPT(n_layer=1, n_head=2, n_embd=16)
    layers = resolve(model).pipeline_layers
    with pytest.raises(PlanError, match="5 pipeline stages need at least 5 pipeline layers.*has 4"):
        split_stages(model, layers, 5)
    with pytest.raises(PlanError, match="split_points=\\[3, 1\\]"):
        split_stages(model, layers, 3, split_points=[3, 1])


def test_tied_weights_across_pipeline_layers_are_refused():
    model = GPT(n_layer=1, n_head=2, n_embd=16)
    model.head.weight = model.tok_emb.weight
    with pytest.raises(PlanError, match="head.weight is the same tensor as tok_emb.weight"):
        resolve(model, num_stages=2)


def test_parameters_outside_pipeline_layers_are_refused():
    model = GPT(n_layer=1, n_head=2, n_embd=16)
    model.extra = nn.Linear(2, 2)
    with pytest.raises(PlanError, match="parameters outside pipeline_layers: extra.weight"):
        resolve(model, num_stages=2)


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        (
            "fsdp2",
            [
                "--trainer.devices=2",
                '--trainer.strategy.mesh_shape=[[2, 1], ["fsdp", "tp"]]',
                "--data.init_args.batch_size=4",
            ],
        ),
        (
            "one_process",
            [
                "--trainer.devices=1",
                '--trainer.strategy.mesh_shape=[[1], ["fsdp"]]',
                "--data.init_args.batch_size=8",
                f"--trainer.max_steps={RESUME_AT + 2}",
            ],
        ),
    ],
)
def test_1f1b_checkpoint_resumes_in_another_layout_with_the_same_next_losses(tmp_path, corpus, reference, name, layout):
    """Stages keep parameter names, so a pp=2 checkpoint loads under fsdp_tp [[2, 1]] and in one process."""
    pp = reference("1f1b.yaml")
    resume = f"--ckpt_path={pp.checkpoint}"
    assert_ok(fit("hybrid.yaml", tmp_path / "resumed", *common(corpus, tmp_path / "cache"), resume, *layout))
    resumed = step_losses(tmp_path / "resumed")
    assert min(resumed) == RESUME_AT
    assert_same_losses({s: v for s, v in pp.losses().items() if s in resumed}, resumed)


def test_schedule_stats_log_busy_time_and_bubble_next_to_theory(tmp_path, corpus):
    assert_ok(
        fit(
            "1f1b.yaml",
            tmp_path,
            *common(corpus, tmp_path / "cache"),
            "--trainer.max_steps=3",
            "--trainer.strategy.schedule_stats=true",
        )
    )
    theory = step_losses(tmp_path, "pp_bubble_theory")
    assert list(theory.values()) == pytest.approx([1 / 5] * 3)  # (p - 1) / (m + p - 1) with p=2, m=4
    overall = step_losses(tmp_path, "pp_bubble")
    assert sorted(overall) == [0, 1, 2] and all(0 < b < 1 for b in overall.values())  # logged at every step
    for rank in (0, 1):
        busy = step_losses(tmp_path, f"pp_busy_s/rank{rank}")
        bubble = step_losses(tmp_path, f"pp_bubble/rank{rank}")
        assert sorted(busy) == sorted(bubble) == [0, 1, 2]
        assert all(b > 0 for b in busy.values()) and all(0 <= b < 1 for b in bubble.values())


def test_pipelined_predict_returns_the_unsplit_models_outputs_on_every_rank(tmp_path):
    proc = script("pipeline_predict.py", cwd=tmp_path)
    assert_ok(proc)
    assert proc.stdout.count("predictions equal the unsplit model's") == 2
