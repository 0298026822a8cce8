"""What the README's main command prints: the progress bar, the model summary and Lightning's start-up lines, and no
warning that is not about the user's own code."""

import re

from support import REPO, assert_ok, parallelkit

NOISE = re.compile(r"Warning|warn\(|deprecated|It is recommended|FLOPs|Epoch \d+/-|Tip:|Traceback", re.IGNORECASE)


def test_main_command_prints_no_warning_that_is_not_about_the_users_code(tmp_path, corpus):
    proc = parallelkit(
        "fit",
        "--config",
        str(REPO / "configs" / "hybrid.yaml"),
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
    assert not NOISE.findall(output), [line for line in output.splitlines() if NOISE.search(line)]
