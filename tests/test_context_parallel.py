"""Context parallelism (a `cp` mesh axis, `parallelkit.parallel.context_parallel`): the balanced split of a sequence
over cp ranks, both attention methods against one process's attention on real process groups, and the GPT trained
with each method, with fsdp and with tp, step by step equal to one process (its gradients too)."""

import json

import pytest
import torch
from hf_families import tiny_config
from models import TINY_LLAMA, TinyMixer
from snippets import parallelkit_args
from support import (
    REPO,
    STEPS,
    assert_ok,
    assert_same_losses,
    callback,
    common,
    fit,
    in_repo,
    parallelkit,
    step_losses,
    torchrun,
)

from parallelkit.errors import PlanError
from parallelkit.models import GPT, HFCausalLM
from parallelkit.parallel import resolve
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
    with pytest.raises(PlanError, match=r"each tp rank holds 6 query and 2 key/value heads, cp=4.*cp_method=allgather"):
        check_heads(6, 2, 4)


def test_both_methods_give_one_processs_attention_and_gradients_across_the_split(tmp_path):
    """4 ranks: cp = 2 (two groups) and cp = 4; unpacked rows and packed rows whose documents cross the chunks'
    edges; grouped-query attention (all-gather; Ulysses where cp divides the key/value heads); a scale, a sliding
    window and a score softcap (what transformers' attention modules pass). Outputs and q, k, v gradients equal one
    process's to 1e-9 (float64)."""
    proc = torchrun("context_parallel_attention.py", 4, cwd=tmp_path)
    assert_ok(proc)
    checked = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(checked) == 28 and {
        "ulysses cp=4 kv_heads=4 packed",
        "allgather cp=4 kv_heads=2 packed",
        "allgather cp=4 kv_heads=2 packed capped",
        "ulysses cp=2 kv_heads=2 packed windowed",
    } <= set(checked)


LAYOUTS = ("allgather_fsdp2_cp2", "ulysses_fsdp2_cp2", "allgather_cp2_tp2")
"""The long-sequences guide's three commands, in order: [[2, 2], ["fsdp", "cp"]] by each method, and cp x tp (sequence
parallelism inside each cp slice); a global batch of 8 each (cp and tp ranks share their replica's rows)."""


def cp_run(reference, name: str):
    command, flag, config, *layout = parallelkit_args("cp-gpt", LAYOUTS.index(name))
    assert (command, flag, config) == ("fit", "--config", "configs/hybrid.yaml")
    extra = (callback("models.FirstGradients", path="first_gradients.pt"),) if name == "allgather_fsdp2_cp2" else ()
    return reference("hybrid.yaml", *layout, *extra)


@pytest.mark.parametrize("name", LAYOUTS)
def test_gpt_with_sequences_split_over_cp_matches_one_process_per_step(baseline, reference, name):
    """20 steps of hybrid.yaml's GPT, each sequence split over 2 cp ranks (the guide's commands), against the
    session's one process."""
    assert_same_losses(baseline("plain").losses(), cp_run(reference, name).losses())


def test_the_cp_runs_first_gradients_are_one_processs(tmp_path, corpus, reference):
    """The gradients, not only the loss: every parameter's at the first step of the [[2, 2], ["fsdp", "cp"]] run,
    gathered whole, equal one process's on the same batch (1e-5)."""
    run = cp_run(reference, "allgather_fsdp2_cp2")
    split = run.log / "first_gradients.pt"  # written in the run's directory, its working directory
    one = callback("models.FirstGradients", path=str(tmp_path / "one.pt"))
    assert_ok(fit("single.yaml", tmp_path, *common(corpus, tmp_path / "cache", steps=1), one))
    expected, actual = torch.load(tmp_path / "one.pt"), torch.load(split)
    assert expected.keys() == actual.keys() and len(expected) > 10
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_lora_on_hsdp_x_cp_with_every_block_recomputed_matches_one_processs_lora(reference):
    """Adapters on q and v of the GPT, on [[2, 1, 2], ["replicate", "fsdp", "cp"]] (HSDP: the cp ranks shard, the
    replicas all-reduce) with activation checkpointing (the attention's collectives run again in backward): 20 steps
    equal one process's LoRA run."""
    lora = '--model.init_args.lora={"rank": 4, "targets": ["attn.q", "attn.v"]}'
    layout = ('--trainer.strategy.mesh_shape=[[2, 1, 2], ["replicate", "fsdp", "cp"]]', "--data.init_args.batch_size=4")
    recomputed = "--trainer.strategy.activation_checkpointing=full"
    losses = reference("hybrid.yaml", lora, *layout, recomputed).losses()
    assert_same_losses(reference("single.yaml", lora).losses(), losses)
    assert losses[STEPS - 1] < losses[0]


def test_each_process_holds_at_most_0_3x_one_processs_activations_at_cp_4(tmp_path, corpus):
    """configs/long_context.yaml (one 4096-token sequence a step, Ulysses) at cp = 4 against the same config on one
    process, 2 steps each: the largest rank's bytes saved for backward (RankMonitor's `memory/activations_mb`) at most
    0.3x (measured 0.25x), and the same losses."""
    activations, losses = {}, {}
    for cp in (1, 4):
        run = tmp_path / f"cp{cp}"
        layout = (f'--trainer.strategy.mesh_shape=[[{cp}], ["cp"]]', f"--trainer.devices={cp}")
        assert_ok(fit("long_context.yaml", run, *common(corpus, tmp_path / "cache", steps=2), *layout))
        activations[cp], losses[cp] = step_losses(run, "memory/activations_mb")[1], step_losses(run)
    assert activations[4] <= 0.3 * activations[1], activations
    assert_same_losses(losses[1], losses[4])


def test_what_cp_cannot_split_is_refused_naming_it():
    with pytest.raises(PlanError, match=r"cp=2, but TinyMixer declares no attention modules.*Fix: name"):
        resolve(TinyMixer(), cp=2)
    with pytest.raises(PlanError, match=r"cp_method='ulysses' needs.*each tp rank holds 3 query"):
        resolve(GPT(n_layer=1, n_head=6, n_embd=48), tp=2, cp=2, cp_method="ulysses")
    with pytest.raises(PlanError, match=r"cp_method='ring' is not a context-parallel method"):
        resolve(GPT(n_layer=1), cp=2, cp_method="ring")
    assert resolve(GPT(n_layer=2), cp=2).attention == ["blocks.0.attn", "blocks.1.attn"]


def test_a_hugging_face_family_cp_cannot_split_is_refused_naming_the_family_and_why():
    """The family sweep decides (attention sinks: gpt-oss); heads for Ulysses come from the config; a config's
    attention dropout, which the split attention does not apply."""
    with pytest.raises(PlanError, match=r"HFCausalLM \(gpt_oss\): .*'gpt_oss' does not compute its own logits.*Fix"):
        resolve(HFCausalLM(tiny_config("gpt_oss")), cp=2)
    llama = {"model_type": "llama", **TINY_LLAMA}
    with pytest.raises(PlanError, match=r"each tp rank holds 4 query and 2 key/value heads, cp=4"):
        resolve(HFCausalLM(llama), cp=4, cp_method="ulysses")
    with pytest.raises(PlanError, match=r"attention_dropout=0.1, which parallelkit's attention across cp ranks"):
        resolve(HFCausalLM({**llama, "attention_dropout": 0.1}), cp=2)
    assert resolve(HFCausalLM(llama), cp=4).attention == [
        "model.model.layers.0.self_attn",
        "model.model.layers.1.self_attn",
    ]


def test_the_long_context_config_is_read_as_a_cp_layout(tmp_path):
    """The README's command: configs/long_context.yaml (4096 tokens, cp 4, Ulysses) parses as the CLI reads it."""
    proc = parallelkit(*in_repo(parallelkit_args("long-context")), "--print_config", cwd=tmp_path)
    assert_ok(proc)
    assert "mesh_shape:" in proc.stdout and "cp_method: ulysses" in proc.stdout and "seq_len: 4096" in proc.stdout


def test_predict_on_a_cp_mesh_is_refused_with_the_fix(tmp_path):
    """Each rank would predict its slice of every sequence: refused on every rank, said once."""
    mesh = '--trainer.strategy.mesh_shape=[[2, 2], ["fsdp", "cp"]]'
    proc = parallelkit("predict", "--config", str(REPO / "configs" / "hybrid.yaml"), mesh, cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in output and output.count("parallelkit: error:") == 1, output
    assert "each cp rank holds a slice of every sequence" in output and "Fix: predict on a mesh without cp" in output
