"""Context parallelism's pieces (`parallelkit.parallel.context_parallel`): the balanced split of a sequence over cp
ranks, and both attention methods against one process's attention on real process groups."""

import json

import pytest
import torch
from support import assert_ok, torchrun

from parallelkit.errors import PlanError
from parallelkit.parallel.context_parallel import SequenceSplit, check_heads


def test_each_rank_holds_chunk_i_and_its_mirror_and_the_gathered_order_is_undone():
    halves = [SequenceSplit(2, rank).indices(8).tolist() for rank in (0, 1)]
    assert halves == [[0, 1, 6, 7], [2, 3, 4, 5]]  # causal work: 1 + 2 + 7 + 8 = 3 + 4 + 5 + 6 keys attended
    quarters = [SequenceSplit(4, rank).indices(16).tolist() for rank in range(4)]
    assert quarters[0] == [0, 1, 14, 15] and quarters[3] == [6, 7, 8, 9]
    assert sorted(sum(quarters, [])) == list(range(16))  # every token held once
    split = SequenceSplit(4, 1)
    assert split.gathered(16)[split.order(16)].tolist() == list(range(16))
    row = torch.arange(32).view(2, 16)
    assert split.take(row).tolist() == [[2, 3, 12, 13], [18, 19, 28, 29]]


def test_a_sequence_or_head_count_the_split_cannot_take_is_refused_with_the_numbers_and_a_fix():
    with pytest.raises(PlanError, match=r"data.seq_len=100 is not divisible by 2 x cp = 8.*Fix: data.seq_len=96"):
        SequenceSplit(4, 0).check(100)
    with pytest.raises(PlanError, match=r"this rank holds 6 query and 2 key/value heads, cp=4.*method=allgather"):
        check_heads(6, 2, 4)


def test_both_methods_give_one_processs_attention_and_gradients_across_the_split(tmp_path):
    """4 ranks: cp = 2 (two groups) and cp = 4; unpacked rows and packed rows whose documents cross the chunks'
    edges; grouped-query attention (all-gather; Ulysses where cp divides the key/value heads). Outputs and q, k, v
    gradients equal one process's to 1e-9 (float64)."""
    proc = torchrun("context_parallel_attention.py", 4, cwd=tmp_path)
    assert_ok(proc)
    checked = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (
        len(checked) == 14
        and "ulysses cp=4 kv_heads=4 packed" in checked
        and "allgather cp=4 kv_heads=2 packed" in checked
    )
