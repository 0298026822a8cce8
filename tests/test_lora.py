"""LoRA fine-tuning (`parallelkit.adapters.lora`) of a pretrained Hugging Face Llama under fsdp x tp and pipeline
layouts: per-step losses equal to one process's, adapters split as their layers are, checkpoints of the adapters that
resume exactly in any layout, and adapters exported in PEFT's format that peft loads with the same outputs."""

import json

import pytest
import torch
from models import TINY_LLAMA
from snippets import parallelkit_args, snippet
from support import (
    FIRST_BATCH,
    RESUME_AT,
    STEPS,
    assert_ok,
    assert_own_tokenizer,
    assert_same_losses,
    callback,
    common,
    fit,
    guide_command,
    parallelkit,
    step_losses,
)
from transformers import AutoModelForCausalLM

from parallelkit.adapters.lora import LoRALinear, add_adapters
from parallelkit.checkpoint import MODEL_PREFIX, CheckpointError, consolidate, read_metadata
from parallelkit.errors import ConfigError
from parallelkit.init import materialize, meta_parameters
from parallelkit.models import GPT, HFCausalLM
from parallelkit.models.hf_export import export_hf

CONFIG = "lora.yaml"
"""A Llama (4 heads, 2 key/value heads) with rank-8 adapters on q, k, v and o, on FSDP2 x tp [[2, 2]], meta_init."""

ONE_PROCESS = ("--trainer.strategy=auto", "--trainer.devices=1", "--data.init_args.batch_size=8")
LORA = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}


@pytest.fixture(scope="module")
def pretrained(pretrained_llama):
    """The base model: a user's directory of the tiny Llama, its tokenizer beside it."""
    return pretrained_llama("tiny")


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("state")


def from_base(pretrained, *overrides: str) -> tuple[str, ...]:
    """The guide's command for a user's own model (docs/guides/lora-qlora.md): its directory, its tokenizer on the
    text. The text is the suite's corpus, which `reference` gives after these."""
    return guide_command("lora-finetune", "configs/lora.yaml", pretrained, *overrides)


def mesh(shape: str, devices: int, batch_size: int, *extra: str) -> tuple[str, ...]:
    return (
        f"--trainer.strategy.mesh_shape={shape}",
        f"--trainer.devices={devices}",
        f"--data.init_args.batch_size={batch_size}",
        *extra,
    )


def state_bytes(out) -> str:
    return callback("models.StateBytes", out_dir=str(out))


TP2 = mesh('[[1, 2], ["fsdp", "tp"]]', 2, 8, "--trainer.strategy.profile_communication=true")
LAYOUTS = {
    "tp2": TP2,
    "1f1b_pp2": (
        "--trainer.strategy=parallelkit.PipelineStrategy",
        "--trainer.strategy.schedule=1f1b",
        "--trainer.strategy.meta_init=true",
        *mesh('[[2], ["pp"]]', 2, 8),
    ),
}


def lora_run(reference, pretrained, state_dir, name: str):
    """A reference LoRA run of configs/lora.yaml from the pretrained base under `name`'s layout (shared by the tests
    that read it); under tp2 each rank writes its bytes of parameters, gradients and optimizer state."""
    if name == "2x2":
        return reference(CONFIG, *from_base(pretrained, FIRST_BATCH))  # configs/lora.yaml's layout; checkpointing
    extra = (state_bytes(state_dir / "lora_tp2"),) if name == "tp2" else ()
    return reference(CONFIG, *from_base(pretrained, *LAYOUTS[name], *extra))


def test_the_guides_command_feeds_a_users_model_its_own_tokenizer(corpus, reference, pretrained):
    """The guide's LoRA command on a user's `save_pretrained` directory (tokenizer included): the first batch is that
    tokenizer's encoding of the text (the byte-level TextDataModule of configs/lora.yaml is refused for such a model
    before launch: test_errors.py)."""
    assert_own_tokenizer(lora_run(reference, pretrained, None, "2x2").log, pretrained, corpus, seq_len=64)


@pytest.mark.parametrize("name", ["2x2", *LAYOUTS])
def test_lora_matches_single_process_losses(reference, pretrained, state_dir, name):
    expected = reference(CONFIG, *from_base(pretrained, *ONE_PROCESS)).losses()
    assert_same_losses(expected, lora_run(reference, pretrained, state_dir, name).losses())


def test_a_users_module_with_adapters_through_the_contract_matches_single_process_on_2x2(reference):
    """`models.WrappedNetworkWithAdapters`: a LightningModule calling its network as `self.model(x)`, which adds
    adapters with one `add_adapters` call; its own tp plan and fsdp units apply to the adapted layers unchanged."""
    model = "--model=models.WrappedNetworkWithAdapters"
    losses = reference("hybrid.yaml", model).losses()
    assert_same_losses(reference("single.yaml", model).losses(), losses)
    assert losses[STEPS - 1] < losses[0]


def test_a_pipeline_rank_left_without_adapters_is_refused_with_the_fix():
    """ZB-V on pp=2 puts the embedding, final norm and head (stages 0 and 3) on rank 0: with adapters on attention
    only, nothing there trains, and its optimizer would be empty. Every rank refuses the split alike, before any
    stage is built, with the fix (by hand: `split_points: [2, 3, 4]` then matches one process, 1.8e-7; the error
    reaches the user once, exit 2, as every error every rank meets: test_errors.py)."""
    import lightning as L

    from parallelkit import PipelineStrategy
    from parallelkit.errors import PlanError
    from parallelkit.parallel import resolve
    from parallelkit.parallel.resolve import split_stages

    with meta_parameters():
        model = HFCausalLM({"model_type": "llama", **TINY_LLAMA}, lora=LORA)
    layers = resolve(model).pipeline_layers
    for schedule, split, refused in (("zbv", None, True), ("zbv", [2, 3, 4], False), ("1f1b", None, False)):
        strategy = PipelineStrategy(mesh_shape=[[2], ["pp"]], schedule=schedule)
        L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)
        stages = split_stages(model, layers, strategy.num_stages, split)
        if not refused:
            strategy._check_every_rank_trains(model, stages)
            continue
        with pytest.raises(PlanError) as error:
            strategy._check_every_rank_trains(model, stages)
        assert str(error.value).startswith("pipeline rank 0 holds stages [0, 3] (model.model.embed_tokens, ")
        assert "none of their parameters trains" in str(error.value) and "Fix: split_points" in str(error.value)


def test_lora_on_tp2_adds_no_gather_and_holds_a_fraction_of_full_fine_tunings_state(
    tmp_path, corpus, reference, pretrained, state_dir
):
    """On [[1, 2]] with sequence parallelism, per step: exactly the all-gathers and reduce-scatters the plan implies,
    for the Hugging Face Llama fully fine-tuned (one all-gather per attention and per MLP input, none of a weight) and
    one fewer of each with adapters (they follow their layer's split; their gradients' all-reduces are new; 11 and 8
    against 12 and 9, as the frozen embedding and first layer's input need no gradient). Per rank:
    gradients and AdamW's two moments for the adapters alone, so parameters + gradients + optimizer state is the
    parameters plus 3 x the adapters (full fine-tuning: 4 x the parameters)."""
    with_lora = lora_run(reference, pretrained, state_dir, "tp2").log
    full = tmp_path / "full"
    steps = common(corpus, tmp_path / "cache", steps=RESUME_AT - 1)  # the reference's steps before its checkpoint
    disable = "--model.init_args.lora=null"
    assert_ok(fit(CONFIG, full, *steps, *from_base(pretrained, disable, *TP2, state_bytes(state_dir / "full_tp2"))))
    # Exact, per step, for this 2-layer Llama (L = 2): no weight is gathered (fsdp is 1; tp splits every weight once)
    # and each attention and MLP all-gathers its input once. Full fine-tuning: all-gathers 2L (attention and MLP
    # inputs) + 1 (the head's input) + 1 (the logits over the vocab) in forward, 2L (o_proj's and down_proj's
    # reduce-scatters) + 1 (layer 0's sequence shard) in backward, + 1 (RankMonitor's step times) = 12; reduce-scatters
    # 2L (o_proj, down_proj) in forward, 2L + 1 (the gathered inputs) in backward = 9. With the adapters, the frozen
    # embedding and layer 0's frozen input norm need no gradient: no backward gather of layer 0's input (11), and no
    # reduce-scatter of its attention's input gradient (8).
    expected = {"all_gather": (11.0, 12.0), "reduce_scatter": (8.0, 9.0)}
    for kind in ("all_gather", "reduce_scatter"):
        counts = [step_losses(log, f"comm/{kind}_count") for log in (with_lora, full)]
        compared = range(RESUME_AT - 1)  # the checkpoint's save gathers too, in the step before RESUME_AT
        assert [{counts[i][s] for s in compared} for i in range(2)] == [{n} for n in expected[kind]], (kind, counts)
    lora = [json.loads(p.read_text()) for p in sorted((state_dir / "lora_tp2").glob("rank*.json"))]
    whole = [json.loads(p.read_text()) for p in sorted((state_dir / "full_tp2").glob("rank*.json"))]
    assert len(lora) == len(whole) == 2
    for mine, theirs in zip(lora, whole):
        adapters = mine["trainable_params"]
        assert mine["optimized_params"] == 2 * 2 * 4  # lora_A and lora_B of q, k, v, o in 2 layers
        assert mine["grads"] == adapters and mine["optimizer"] == 2 * adapters
        assert mine["bytes"] == mine["params"] + 3 * adapters
        assert theirs["bytes"] == 4 * theirs["params"]
        assert mine["params"] == theirs["params"] + adapters  # the same base, plus the adapters
        # This tiny model: 304,384 B against 857,088 B per rank (0.355; the adapters are 10% of its weights per rank).


def test_lora_checkpoint_holds_the_adapters_and_resumes_exactly_on_2x2_and_in_one_process(
    tmp_path, corpus, reference, pretrained
):
    run = lora_run(reference, pretrained, None, "2x2")
    names = {
        k[len(MODEL_PREFIX) :] for k in read_metadata(run.checkpoint).state_dict_metadata if k.startswith(MODEL_PREFIX)
    }
    assert len(names) == 16 and all(n.endswith((".lora_A", ".lora_B")) for n in names), sorted(names)
    for name, layout in (("2x2", ()), ("one_process", mesh('[[1], ["fsdp"]]', 1, 8))):
        out = tmp_path / name
        stop = callback("models.StopAfter", step=RESUME_AT + 2)  # two steps; the LR schedule still plans for all
        resume = f"--ckpt_path={run.checkpoint}"
        assert_ok(fit(CONFIG, out, *common(corpus, tmp_path / "cache"), *from_base(pretrained), *layout, resume, stop))
        resumed = step_losses(out)
        assert sorted(resumed) == [RESUME_AT, RESUME_AT + 1]
        assert_same_losses({s: run.losses()[s] for s in resumed}, resumed)


def test_exported_adapters_load_with_peft_and_the_merged_model_with_transformers_giving_parallelkits_logits(
    tmp_path, corpus, reference, pretrained
):
    """The [[2, 2]] run's adapters at step `RESUME_AT`: `export-hf --adapters` writes PEFT's format, which
    `PeftModel.from_pretrained` puts on the base model; `export-hf` merges them into the base weights. Both give
    the logits of parallelkit's model holding those adapters, within 1e-5."""
    ckpt = lora_run(reference, pretrained, None, "2x2").checkpoint
    place = {
        "runs/lora/checkpoints/last.ckpt": str(ckpt),  # its step-`RESUME_AT` checkpoint
        "/data/my-adapter": str(tmp_path / "adapters"),
        "/data/Llama-3.2-1B-merged": str(tmp_path / "merged"),
        "/data/Llama-3.2-1B": str(pretrained),
    }
    for index in (1, 2):  # the guide's two exports
        assert_ok(parallelkit(*parallelkit_args("lora-finetune", index, **place), cwd=tmp_path))
    adapters = torch.load(consolidate(ckpt, tmp_path / "adapters.pt"), weights_only=True)
    model = HFCausalLM(pretrained=str(pretrained), lora=LORA)
    missing, unexpected = model.load_state_dict(adapters, strict=False)
    assert not unexpected and all(not model.get_parameter(n).requires_grad for n in missing)
    tokens = torch.randint(0, TINY_LLAMA["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(pretrained)
    loaded: dict = {}  # the guide's Python: PEFT puts the adapters on the base
    exec(
        snippet("lora-peft")
        .text.replace("/data/my-adapter", str(tmp_path / "adapters"))
        .replace("/data/Llama-3.2-1B", str(pretrained)),
        loaded,
    )
    with torch.no_grad():
        expected = model.eval()(tokens)
        untuned = base(tokens).logits
        by_peft = loaded["model"].eval()(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(tokens).logits
    assert (expected - untuned).abs().max() > 1e-3  # the adapters changed the model: the comparison can fail
    torch.testing.assert_close(by_peft, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-5)


def test_adapters_are_found_by_name_suffix_and_what_cannot_be_adapted_is_named():
    gpt = GPT(n_layer=2, n_head=2, n_embd=16)
    adapted = add_adapters(gpt, {"rank": 2, "targets": ["attn.q", "*.v"]})
    assert adapted == ["blocks.0.attn.q", "blocks.0.attn.v", "blocks.1.attn.q", "blocks.1.attn.v"]
    trainable = [n for n, p in gpt.named_parameters() if p.requires_grad]
    assert trainable == [f"{m}.{p}" for m in adapted for p in ("lora_A", "lora_B")]
    everything = add_adapters(GPT(n_layer=1, n_head=2, n_embd=16), {"rank": 2})  # all-linear: not the output head
    assert everything == [f"blocks.0.{m}" for m in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.up", "mlp.down")]
    with pytest.raises(ConfigError, match=r"'q_proj' matches no module of GPT.*end in: down, head, k, proj, q, up, v"):
        add_adapters(GPT(n_layer=1, n_head=2, n_embd=16), {"targets": ["q_proj"]})
    with pytest.raises(ConfigError, match=r"blocks.0.attn_norm \(RMSNorm\): adapters go on torch.nn.Linear layers"):
        add_adapters(GPT(n_layer=1, n_head=2, n_embd=16), {"targets": ["attn_norm"]})
    with pytest.raises(ConfigError, match=r"rank=0 must be a positive integer.*dropout=1.5 must be in \[0, 1\)"):
        GPT(n_layer=1, n_head=2, n_embd=16, lora={"rank": 0, "dropout": 1.5})


def test_adapters_start_as_the_base_model_and_are_the_same_built_on_meta_or_eagerly():
    """B starts at zero (the adapted model computes what the base does); A is drawn from the seed and the module's
    name, so an eager build and a meta-device build materialised later hold the same adapters, and the global
    generator advances as without adapters."""
    torch.manual_seed(0)
    plain = GPT(n_layer=2, n_head=2, n_embd=16)
    after_plain = torch.rand(1)
    torch.manual_seed(0)
    eager = GPT(n_layer=2, n_head=2, n_embd=16, lora={"rank": 4})
    assert torch.equal(torch.rand(1), after_plain)
    torch.manual_seed(0)
    with meta_parameters():
        meta = GPT(n_layer=2, n_head=2, n_embd=16, lora={"rank": 4})
    materialize(meta, torch.device("cpu"), dict(meta.named_modules()))
    assert torch.equal(torch.rand(1), after_plain)
    assert isinstance(meta.blocks[0].attn.q, LoRALinear)
    for key, value in eager.state_dict().items():
        assert torch.equal(meta.state_dict()[key], value), key
    assert eager.blocks[0].attn.q.lora_A.abs().sum() > 0 and eager.blocks[0].attn.q.lora_B.abs().sum() == 0
    tokens = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(eager(tokens), plain(tokens), rtol=0, atol=0)


def test_hf_model_takes_lora_from_the_config_and_keeps_the_base_frozen_on_meta_too():
    config = {"model_type": "llama", **TINY_LLAMA}
    with meta_parameters():
        model = HFCausalLM(config, lora=LORA)
    attention = model.model.model.layers[0].self_attn
    assert all(isinstance(getattr(attention, p), LoRALinear) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert not isinstance(model.model.model.layers[0].mlp.up_proj, LoRALinear)
    assert model.hparams.lora == {
        **LORA,
        "quantize_base": None,
        "quantize_others": False,
        "init_from": None,
    }  # plain values: a checkpoint's hyperparameters load with weights_only=True
    assert sum(p.requires_grad for p in model.parameters()) == 16


def test_export_of_adapters_on_a_base_drawn_from_the_seed_writes_them_alone_and_refuses_to_merge(tmp_path):
    """A LoRA checkpoint holds the adapters only; when the base came from the seed, not from a pretrained directory,
    there is nothing to merge them into: `export-hf` says so with the fix, and `--adapters` writes them."""
    model = HFCausalLM({"model_type": "llama", **TINY_LLAMA}, lora=LORA)
    trainable = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    torch.save({"state_dict": trainable, "hyper_parameters": dict(model.hparams)}, tmp_path / "last.ckpt")
    with pytest.raises(CheckpointError, match=r"came from the seed.*Fix: export the adapters alone with --adapters"):
        export_hf(tmp_path / "last.ckpt", tmp_path / "merged")
    out = export_hf(tmp_path / "last.ckpt", tmp_path / "adapters", adapters=True)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16.0 and len(config["target_modules"]) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapters", "last.ckpt"]  # nothing left half-written
