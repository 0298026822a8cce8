"""ReplicaMonitor: replicated parameters compared across ranks during training. Runs where replicas stay equal are in
`test_fsdp_tp.py::test_layout_matches_single_process_losses` (every layout there, HSDP included, with
`on_mismatch="raise"`) and `test_hf.py` (Qwen3's per-head norms on [[1, 2]] and [[2, 2]]); here, replicas trained
apart on purpose must be caught and named."""

import json

import pytest
import torch.distributed as dist
from support import assert_ok, callback, common, fit
from test_hf import LLAMA, qwen3

from parallelkit.callbacks import ReplicaMonitor
from parallelkit.errors import ParallelkitError

EVERY_5 = callback("parallelkit.callbacks.ReplicaMonitor", every_n_steps=5)


def mismatches(proc) -> list[str]:
    return [" ".join(line.split()) for line in proc.stderr.splitlines() if "replica mismatch" in line]


def test_one_ranks_copy_of_a_tp_replicated_norm_perturbed_is_caught_at_the_next_check(tmp_path, corpus):
    """[[2, 2]] with sequence parallelism: each tp pair holds the norms whole (per fsdp shard). Rank 1's copy of one
    norm is moved after step 7; the check at step 5 finds nothing, the one at step 10 names the norm, rank 1, its
    tp partner and the axis."""
    perturb = callback("models.PerturbReplica", name="blocks.1.mlp_norm.weight", step=7, rank=1)
    proc = fit("hybrid.yaml", tmp_path, *common(corpus, tmp_path / "cache", steps=10), EVERY_5, perturb)
    assert_ok(proc)
    found = mismatches(proc)
    assert len(found) == 1, found
    assert (
        "replica mismatch at step 10: blocks.1.mlp_norm.weight differs on rank 1 from rank 0 along the tp axis"
        in (found[0])
    )


def test_per_head_norms_without_their_tp_reduction_are_caught(tmp_path, corpus):
    """Qwen3 on [[1, 2]] with q_norm/k_norm left out of the tp plan (test-only `NoHeadNormReduction`): each tp rank
    sums only its own heads' gradient into its copy of the norm, so the copies train apart, silently. Caught at the
    first check."""
    model = (*qwen3(), '--trainer.strategy.mesh_shape=[[1, 2], ["fsdp", "tp"]]', "--trainer.devices=2")
    broken = callback("models.NoHeadNormReduction")
    proc = fit(LLAMA, tmp_path, *common(corpus, tmp_path / "cache", steps=5), *model, EVERY_5, broken)
    assert_ok(proc)
    found = mismatches(proc)
    assert len(found) == 1 and "replica mismatch at step 5: model.model.layers.0.self_attn." in found[0], found
    assert "_norm.weight differs on rank 1 from rank 0 along the tp axis" in found[0]


@pytest.mark.parametrize("args", [{"every_n_steps": 0}, {"on_mismatch": "warn"}])
def test_bad_monitor_settings_are_one_error_with_the_fix(args):
    with pytest.raises(ParallelkitError, match="Fix: e.g. every_n_steps=100"):
        ReplicaMonitor(**args)
    assert not dist.is_initialized()
    json.dumps(args)
