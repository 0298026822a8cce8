"""The template plugin, installed with pip: both names resolve, and the hook does what it claims on the wire (the run's
ranks forked by the repository's test harness, tests/README.md)."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import parallelkit

REPO = Path(parallelkit.__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "fsdp.yaml"
PARAMS = 131_392  # the configs' GPT

sys.path.insert(0, str(REPO / "tests"))
from support import assert_ok  # noqa: E402 - the repository's harness: ranks forked from a warm process
from support import parallelkit as cli  # noqa: E402


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def test_strategy_and_hook_are_found_by_name(tmp_path):
    code = (
        "import lightning as L, parallelkit\n"
        "from parallelkit.comm import resolve\n"
        "t = L.Trainer(strategy='zero2', accelerator='cpu', devices=2, logger=False)\n"
        "print(type(t.strategy).__name__, t.strategy.reshard_after_forward, resolve('template_bf16').reduce_dtype)\n"
    )
    assert "ZeRO2Strategy never torch.bfloat16" in run(sys.executable, "-c", code, cwd=tmp_path).stdout


def test_hook_selected_in_yaml_halves_the_reduce_scatter_bytes(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(p.read_text() for p in sorted(Path(parallelkit.__file__).parent.rglob("*.py"))))
    config = tmp_path / "hook.yaml"
    config.write_text(
        "trainer:\n  strategy:\n    class_path: parallelkit_template.ZeRO2Strategy\n"
        "    init_args:\n      mesh_shape: auto\n      comm_precision: template_bf16\n"
        "      profile_communication: true\n"
    )
    proc = cli(
        "fit",
        f"--config={CONFIG}",
        f"--config={config}",
        "--trainer.devices=2",
        "--trainer.max_steps=3",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--data.init_args.paths={corpus}",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
        cwd=tmp_path,
    )
    assert_ok(proc)
    (metrics,) = tmp_path.rglob("metrics.csv")
    with open(metrics) as f:
        sent = {float(r["comm/reduce_scatter_bytes"]) for r in csv.DictReader(f) if r.get("comm/reduce_scatter_bytes")}
    assert sent == {2.0 * PARAMS}  # every gradient once per step, 2 bytes each
