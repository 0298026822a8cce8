"""Hugging Face causal LMs under every strategy, by the models' own parallel plans (`parallelkit.models.HFCausalLM`):
per-step losses equal to one process's, built from configs (no download), meta_init on."""

import json

import pytest
import torch
import transformers  # noqa: F401  the [hf] extra, which .ci/run installs: missing, these tests fail (never skip)
import yaml
from hf_families import tiny_config
from models import GEMMA3, TINY_LLAMA
from snippets import parallelkit_args
from support import REPO, RESUME_AT, assert_ok, assert_same_losses, callback, common, fit, parallelkit, step_losses

from parallelkit.contract import declared_plan
from parallelkit.errors import PlanError
from parallelkit.init import materialize, meta_parameters
from parallelkit.models import HFCausalLM
from parallelkit.parallel import resolve
from parallelkit.planner import Hardware, Workload, profile, recommend, workloads

LLAMA = "hf_llama.yaml"
"""A Llama with grouped-query attention (4 heads, 2 key/value heads), untied, on FSDP2 x tp [[2, 2]], meta_init."""

QWEN3 = {"model_type": "qwen3", **TINY_LLAMA, "head_dim": 16, "tie_word_embeddings": True}
"""Qwen3: per-head norms on q and k (which tp must all-reduce the gradients of), and tied embeddings."""

GPT2 = {
    "model_type": "gpt2",
    "vocab_size": 256,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 256,
    "bos_token_id": 0,  # inside the vocabulary
    "eos_token_id": 0,
    # No dropout: each rank would draw other masks than one process does.
    **dict.fromkeys(("embd_pdrop", "attn_pdrop", "resid_pdrop"), 0.0),
}
"""GPT-2: decoder layers in `transformer.h`, no plans declared (Conv1D layers), tied embeddings, learned positions."""

ONE_PROCESS = ("--trainer.strategy=auto", "--trainer.devices=1", "--data.init_args.batch_size=8")
"""The single-process reference: the same config, no strategy, the whole global batch of 8."""


def qwen3(*overrides: str) -> tuple[str, ...]:
    return (f"--model.init_args.config={json.dumps(QWEN3)}", *overrides)


def mesh(shape: str, devices: int, batch_size: int, *extra: str) -> tuple[str, ...]:
    return (
        f"--trainer.strategy.mesh_shape={shape}",
        f"--trainer.devices={devices}",
        f"--data.init_args.batch_size={batch_size}",
        *extra,
    )


PIPELINE = (
    "--trainer.strategy=parallelkit.PipelineStrategy",
    "--trainer.strategy.schedule=1f1b",
    "--trainer.strategy.meta_init=true",
)

hf_cp_command = parallelkit_args("cp-hf")
assert hf_cp_command[:3] == ["fit", "--config", "configs/hf_llama.yaml"]
LAYOUTS = {
    # [[2, 2]] with default sequence parallelism is the shared reference run (its checkpoint is resumed below).
    "llama_tp2_loss_parallel": ((), mesh('[[1, 2], ["fsdp", "tp"]]', 2, 8, "--trainer.strategy.loss_parallel=true")),
    "qwen3_tied_tp2": (qwen3(), mesh('[[1, 2], ["fsdp", "tp"]]', 2, 8)),
    "qwen3_tied_2x2": (qwen3(), ()),
    "gpt2_fsdp2": ((f"--model.init_args.config={json.dumps(GPT2)}",), mesh('[[2, 1], ["fsdp", "tp"]]', 2, 4)),
    "qwen3_tied_fsdp4_checkpointing": (
        qwen3(),
        mesh('[[4, 1], ["fsdp", "tp"]]', 4, 2, "--trainer.strategy.activation_checkpointing=full"),
    ),
    # Context parallelism through transformers' attention interface: each sequence split over the cp ranks.
    "llama_fsdp2_cp2": ((), tuple(hf_cp_command[3:])),  # the long-sequences guide's command
    "qwen3_tied_fsdp2_cp2_ulysses": (
        qwen3(),
        mesh('[[2, 2], ["fsdp", "cp"]]', 4, 4, "--trainer.strategy.cp_method=ulysses"),
    ),
    "gemma3_sliding_windows_fsdp1_cp4": (
        (f"--model.init_args.config={json.dumps(GEMMA3)}",),
        mesh('[[1, 4], ["fsdp", "cp"]]', 4, 8),  # windows of 8 tokens across slices of 2 x 8
    ),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_hf_model_matches_single_process_losses(tmp_path, corpus, reference, name):
    """Also: what the layout keeps replicated (Qwen3's per-head norms over tp, every norm under tp) stays equal,
    checked every 5 steps by a ReplicaMonitor that would end the run."""
    model, layout = LAYOUTS[name]
    expected = reference(LLAMA, *model, *ONE_PROCESS).losses()
    replicas = callback("parallelkit.callbacks.ReplicaMonitor", every_n_steps=5, on_mismatch="raise")
    assert_ok(fit(LLAMA, tmp_path, *common(corpus, tmp_path / "cache"), *model, *layout, replicas))
    assert_same_losses(expected, step_losses(tmp_path))
    compared = step_losses(tmp_path, "replicas/compared")  # from step 5 on; none under fsdp alone
    assert min(compared) == 4 and (min(compared.values()) > 0) == ("fsdp" not in name), compared


def test_hf_llama_on_2x2_with_sequence_parallelism_matches_single_process_losses(reference):
    assert_same_losses(reference(LLAMA, *ONE_PROCESS).losses(), reference(LLAMA).losses())


@pytest.mark.parametrize(
    ("name", "layout"),
    [
        ("1f1b_pp2", (*PIPELINE, *mesh('[[2], ["pp"]]', 2, 8))),
        ("1f1b_pp2_cp2", (*PIPELINE, *mesh('[[2, 2], ["pp", "cp"]]', 4, 8))),  # stages' attention across the slices
        ("one_process", mesh('[[1], ["fsdp"]]', 1, 8)),
    ],
)
def test_hf_checkpoint_from_2x2_resumes_in_another_layout_with_the_same_next_losses(
    tmp_path, corpus, reference, name, layout
):
    saved = reference(LLAMA)
    stop = callback("models.StopAfter", step=RESUME_AT + 2)  # two steps; the LR schedule still plans for all
    resume = f"--ckpt_path={saved.checkpoint}"
    assert_ok(fit(LLAMA, tmp_path, *common(corpus, tmp_path / "cache"), *layout, resume, stop))
    resumed = step_losses(tmp_path)
    assert sorted(resumed) == [RESUME_AT, RESUME_AT + 1]
    assert_same_losses({s: saved.losses()[s] for s in resumed}, resumed)


def test_tp_not_dividing_the_key_value_heads_is_refused_before_any_process_starts(tmp_path):
    proc = fit(LLAMA, tmp_path, "--trainer.max_steps=1", *mesh('[[1, 4], ["fsdp", "tp"]]', 4, 8), timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert "Initializing distributed" not in output  # refused in the launching process: no rank was started
    error = proc.stderr.rstrip().splitlines()[-1]
    assert "HFCausalLM (llama) has 2 key/value heads (num_key_value_heads), which tp=4 does not divide" in error
    assert 'Fix: a tp that divides 2 (1, 2), e.g. mesh_shape [[-1, 2], ["fsdp", "tp"]]' in error


def build(config: dict, on_meta: bool = False) -> HFCausalLM:
    if on_meta:
        with meta_parameters():
            return HFCausalLM(config)
    return HFCausalLM(config)


def test_meta_init_gives_the_eager_weights_and_keeps_tied_embeddings_tied():
    torch.manual_seed(0)
    eager = build(QWEN3)
    meta = build(QWEN3, on_meta=True)
    assert all(p.is_meta for p in meta.parameters())
    torch.manual_seed(0)
    materialize(meta, torch.device("cpu"), dict(meta.named_modules()))
    for model in (eager, meta):
        assert model.model.lm_head.weight is model.model.model.embed_tokens.weight
    expected = eager.state_dict()
    for key, value in meta.state_dict().items():
        assert torch.equal(value, expected[key]), key
    # Initialised by transformers' own _init_weights: normal(0, initializer_range) matrices, unit norms.
    assert eager.model.model.layers[0].self_attn.q_norm.weight.eq(1).all()
    assert abs(eager.model.model.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 2e-3


def test_plan_reads_the_models_own_tp_and_pipeline_plans():
    contract = declared_plan(build(QWEN3, on_meta=True))
    layers = "model.model.layers.*"
    assert contract.tp[f"{layers}.self_attn.q_proj"] == "colwise"
    assert contract.tp[f"{layers}.self_attn.o_proj"] == "rowwise"
    assert contract.tp[f"{layers}.self_attn.q_norm"] == "head_norm"  # HF: replicated_with_grad_allreduce
    assert contract.tp[f"{layers}.input_layernorm"] == "sequence_parallel"  # added: the residual stream's norms
    assert contract.tp["model.model.embed_tokens"] == "vocab_embedding_whole"  # masks are built from it, whole
    assert contract.tp["model.model.layers.0"] == "shard_sequence"  # the stream is sharded from there on
    assert contract.tp["model.lm_head"] == "vocab_head"
    assert contract.tp_divisors == {
        "attention heads (num_attention_heads)": 4,
        "key/value heads (num_key_value_heads)": 2,
    }
    assert contract.fsdp_units == [layers]
    assert contract.pipeline_layers == ["model.model.embed_tokens", layers, "model.model.norm", "model.lm_head"]


def test_pipeline_refuses_tied_embeddings_and_families_without_a_pipeline_plan_with_the_fix():
    with pytest.raises(PlanError, match="tied weights cannot be split.*tie_word_embeddings: false"):
        resolve(build(QWEN3, on_meta=True), num_stages=2)
    with pytest.raises(PlanError, match="no pipeline plan for gpt2 .*Fix: train it with fsdp_tp"):
        resolve(build(GPT2, on_meta=True), num_stages=2)


def test_gpt2_declares_no_plans_its_layers_are_found_and_its_logits_are_transformers_own():
    model = build(GPT2, on_meta=False).eval()
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(tokens), model.model(input_ids=tokens).logits)
    contract = declared_plan(model)
    assert contract.fsdp_units == ["model.transformer.h.*"]
    with pytest.raises(PlanError, match=r"transformers declares no tensor-parallel plan for gpt2 .* Fix: train it wi"):
        resolve(model, tp=2, plan=contract)


POST_PROCESSED = {
    "cohere": {"logit_scale": 0.0625},  # logits x 1/16 after the head
    "granite": {"logits_scaling": 8.0},  # logits / 8
    "gemma2": {"final_logit_softcapping": 3.0, "head_dim": 16},  # tanh capping; attention eager by default
}
"""Families that change the head's logits before the loss: parallelkit's model must do what theirs does."""


@pytest.mark.parametrize("family", POST_PROCESSED)
def test_a_family_that_scales_its_logits_exports_a_model_with_parallelkits_logits(tmp_path, family):
    from parallelkit.models.hf_export import export_hf

    model = HFCausalLM({"model_type": family, **TINY_LLAMA, **POST_PROCESSED[family]}).eval()
    ckpt = tmp_path / "run.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, ckpt)
    exported = transformers.AutoModelForCausalLM.from_pretrained(export_hf(ckpt, tmp_path / "out"))
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), exported.eval()(input_ids=tokens).logits, rtol=1e-5, atol=1e-6)


def test_an_hf_style_parallelkit_does_not_translate_is_refused_by_name_under_tp_only():
    model = build(tiny_config("minicpm3"), on_meta=True)  # multi-head latent attention: `mla_kv_a_proj`
    contract = declared_plan(model)  # fsdp alone needs no tp plan: the model still trains without a tp axis
    assert contract.fsdp_units == ["model.model.layers.*"]
    with pytest.raises(PlanError, match=r"the style 'mla_kv_a_proj', which parallelkit does not translate; it trans"):
        resolve(model, tp=2, plan=contract)


def test_plan_fits_a_llama_3_8b_config_on_8_devices_and_counts_its_parameters(tmp_path):
    config = REPO / "configs" / "hf_llama3_8b.yaml"
    proc = parallelkit(
        "plan",
        "--config",
        str(config),
        "--devices-per-node",
        "8",
        "--device-memory",
        "80GB",
        "--json",
        cwd=tmp_path,
    )
    assert_ok(proc)
    assert "No seed found" not in proc.stderr, proc.stderr[-3000:]  # a plan draws nothing at random
    report = json.loads(proc.stdout)
    assert report["recommended"]["fits"] and report["recommended"]["peak"] <= 80e9
    with torch.device("meta"):
        model = HFCausalLM(**yaml.safe_load(config.read_text())["model"]["init_args"])
    prof = profile(model, seq_len=8)
    assert prof.params == model.model.num_parameters() == 8_030_261_248
    work = Workload(seq_len=8192, micro_batch=1, compute_bytes=2, global_batch=8)  # the config's: 1 x 8 processes
    _, best, _ = recommend(model, work, Hardware(1, 8, 80e9), search=workloads(work))
    assert best is not None and best.mesh == report["recommended"]["mesh"]


def test_a_family_whose_tp_split_differs_from_one_process_is_refused_by_name():
    apertus = {"model_type": "apertus", **TINY_LLAMA}  # its activation's learnable scalars lie outside the tp plan
    model = build(apertus, on_meta=True)
    with pytest.raises(PlanError, match=r"split tp=2 on two processes, apertus does not compute one process's loss"):
        resolve(model, tp=2)
