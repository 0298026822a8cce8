"""What the README's main command prints: the progress bar, the model summary and Lightning's start-up lines, and no
warning that is not about the user's own code."""

import re

from snippets import commands, parallelkit_args
from support import REPO, assert_ok, assert_same_losses, in_repo, parallelkit, step_losses

NOISE = re.compile(r"Warning|warn\(|deprecated|It is recommended|FLOPs|Epoch \d+/-|Tip:|Traceback", re.IGNORECASE)


def test_main_command_prints_no_warning_that_is_not_about_the_users_code(tmp_path, corpus, baseline):
    """Launched for real (Python's default warning filters change what the interpreter does at start): the README's
    main command through `python -m parallelkit.cli` and Lightning's own launcher, fresh interpreters for every rank,
    is also the fsdp_tp family's production-path parity run (tests/README.md): its steps are one process's."""
    main = parallelkit_args("two-commands")  # the README's main command
    assert main == parallelkit_args("three-ways-in") and commands("index-first-run")[1][1:] == main  # and the site's
    proc = parallelkit(
        *in_repo(main),
        "--trainer.max_steps=4",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=2",
        f"--data.init_args.paths={corpus}",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,
        PYTHONWARNINGS="",  # Python's default filters, as in a user's shell
    )
    assert_ok(proc)
    output = proc.stdout + proc.stderr
    assert "Epoch 0" in output and "Total params" in output and "val_loss" in output  # what a run should show
    assert "v_num" not in output  # the logger's version, as a float ("v_num: 0.000")
    assert not NOISE.findall(output), [line for line in output.splitlines() if NOISE.search(line)]
    losses, expected = step_losses(tmp_path), baseline("plain").losses()
    assert sorted(losses) == [0, 1, 2, 3]
    assert_same_losses({step: expected[step] for step in losses}, losses)


def test_a_dry_run_of_a_hugging_face_preset_prints_nothing_but_its_plan(tmp_path):
    """In a fresh interpreter (the import is where torchao, which transformers imports with every model, speaks):
    a bf16 preset's dry run on CPU prints no torchao kernel-loading failures or Enum deprecations, no "Using bfloat16
    Automatic Mixed Precision" (nothing trains) and no "No seed found" (nothing is drawn)."""
    proc = parallelkit(
        "check",
        "--dry-run",
        "--config",
        str(REPO / "configs" / "models" / "llama3_1_8b.yaml"),
        "--devices-per-node",
        "8",
        "--trainer.strategy=fsdp_tp",
        '--trainer.strategy.mesh_shape=[[8], ["fsdp"]]',
        cwd=tmp_path,
        real_launch=True,  # a fresh interpreter: the forked ranks' server imported transformers (and torchao) already
        PYTHONWARNINGS="",
    )
    assert_ok(proc)
    output = proc.stdout + proc.stderr
    assert "the plan applies on 8 ranks" in output
    quiet = re.compile(r"Failed to load|Enum subclass|Automatic Mixed Precision|No seed found")
    assert not NOISE.findall(output) and not quiet.findall(output), output[-3000:]
