"""Hugging Face families against the reference: every causal-LM family transformers registers gives transformers'
own logits and loss on one process or is refused by name (the sweep, `tests/hf_families.py`, which also decides tp,
pp and cp per family), and families that do more than Llama train on 2 x 2 and in a 1F1B pipeline with one
process's per-step losses."""

import json

import hf_families
import pytest
import transformers
from models import GEMMA3, TINY_LLAMA
from support import REPO, assert_ok, assert_same_losses, common, fit, made_once, step_losses

from parallelkit.models.hf_families import CP_FAMILIES, GENERATED_WITH, PIPELINE_FAMILIES, TP_FAMILIES


def test_every_family_gives_transformers_own_logits_or_is_refused_and_the_families_page_says_which(tmp_path):
    rows = hf_families.with_tp_checked(hf_families.sweep(), tmp_path / "tp.json")  # one launch of 2 processes
    errors = [row.error for row in rows if row.error]
    assert not errors, "HFCausalLM differs from transformers' own model:\n" + "\n".join(errors)
    exact = {row.family for row in rows if row.exact == "yes"}
    assert {"llama", "qwen3", "gemma3_text", "gemma2", "phi3", "olmo2", "cohere", "granite", "gpt2"} <= exact
    pipelined = tuple(row.family for row in rows if row.pp == "yes")
    registered = {row.family for row in rows}
    failing = [family for family in PIPELINE_FAMILIES if family in registered and family not in pipelined]
    assert not failing, f"families HFCausalLM pipelines whose stages no longer compute their logits: {failing}"
    split = tuple(row.family for row in rows if row.tp == "yes")
    failing = [family for family in TP_FAMILIES if family in registered and family not in split]
    assert not failing, f"families HFCausalLM splits tp whose two processes no longer give one's: {failing}"
    sliced = tuple(row.family for row in rows if row.cp == "yes")
    assert {"llama", "qwen3", "gemma3_text", "gemma2", "mistral"} <= set(sliced)  # windows, softcaps (Gemma 2)
    refused = {row.family: row.cp for row in rows}  # by name, each with its reason
    assert "attention sinks" in refused["gpt_oss"] and "attention function be set" in refused["bloom"]
    failing = [family for family in CP_FAMILIES if family in registered and family not in sliced]
    assert not failing, f"families HFCausalLM splits over cp whose split rows no longer give its logits: {failing}"
    if transformers.__version__ == GENERATED_WITH:  # what docs/families.md states is for the version it names
        regenerate = "the sweep found something else: python tests/hf_families.py --write, and review the diff"
        assert pipelined == PIPELINE_FAMILIES, regenerate
        assert split == TP_FAMILIES, regenerate
        assert sliced == CP_FAMILIES, regenerate
        assert hf_families.render_table(rows) in (REPO / "docs" / "families.md").read_text(), regenerate


FAMILIES = {
    "gemma3_text": GEMMA3,  # sliding windows on every other layer
    # Fused qkv_proj and gate_up_proj (column-wise, gathered), o_proj and down_proj rowwise_split_input.
    "phi3": {"model_type": "phi3", **TINY_LLAMA, "pad_token_id": 0, "eos_token_id": 0, "bos_token_id": 0},
    # q/k norms over the whole projection (gathered), o_proj rowwise_split_input.
    "olmo2": {"model_type": "olmo2", **TINY_LLAMA, "pad_token_id": 0},
    # logit_scale: the model's own forward scales the head's logits.
    "cohere": {"model_type": "cohere", **TINY_LLAMA, "logit_scale": 0.0625},
}

LAYOUTS = {
    "2x2": ("--trainer.devices=4",),  # configs/hf_llama.yaml: FSDP2 x tp [[2, 2]], sequence parallelism by default
    "tp2": (
        '--trainer.strategy.mesh_shape=[[1, 2], ["fsdp", "tp"]]',
        "--trainer.devices=2",
        "--data.init_args.batch_size=8",
    ),
    "1f1b_pp2": (
        "--trainer.strategy=parallelkit.PipelineStrategy",
        "--trainer.strategy.schedule=1f1b",
        "--trainer.strategy.meta_init=true",
        '--trainer.strategy.mesh_shape=[[2], ["pp"]]',
        "--trainer.devices=2",
        "--data.init_args.batch_size=8",
    ),
}
STEPS = 8


FAMILIES["gemma3_text_tied"] = {**FAMILIES["gemma3_text"], "tie_word_embeddings": True}  # Gemma 3's default
RUNS = [
    *((family, "2x2") for family in FAMILIES if family != "gemma3_text"),  # Gemma 3 tied, as it ships
    *((family, "1f1b_pp2") for family in FAMILIES if family != "gemma3_text_tied"),  # stages cannot share a tensor
    ("phi3", "tp2"),  # tp alone on a fused gate_up_proj
]


@pytest.mark.parametrize(("family", "layout"), RUNS)
def test_family_matches_single_process_losses(tmp_path, tmp_path_factory, corpus, family, layout):
    model = f"--model.init_args.config={json.dumps(FAMILIES[family])}"

    def one_process(run):
        one = ("--trainer.strategy=auto", "--trainer.devices=1", "--data.init_args.batch_size=8")
        assert_ok(fit("hf_llama.yaml", run, *common(corpus, run / "cache", STEPS), model, *one))

    expected = step_losses(made_once(tmp_path_factory, f"hf-family-{family}", one_process))
    assert_ok(fit("hf_llama.yaml", tmp_path, *common(corpus, tmp_path / "cache", STEPS), model, *LAYOUTS[layout]))
    assert_same_losses(expected, step_losses(tmp_path))
