"""LoRA on a mixture of experts' experts: `lora.targets` naming their stacked parameters (PEFT's `target_parameters`),
one low-rank pair per expert. A small random Qwen3-MoE saved with `save_pretrained`, adapters on attention and on the
experts: trained by transformers + PEFT in one process (the reference, `models.PeftCausalLM`) and by parallelkit
under expert parallelism, the exported adapters loaded by PEFT, and what cannot be adapted refused by name."""

import json

import pytest
import torch
import yaml
from snippets import parallelkit_args
from support import (
    REPO,
    RESUME_AT,
    STEPS,
    assert_ok,
    assert_same_losses,
    callback,
    checkpoint_every,
    common,
    fit,
    parallelkit,
    step_losses,
)
from test_moe import LAYOUTS as MOE_LAYOUTS

from parallelkit.adapters.experts import expert_parameters
from parallelkit.adapters.lora import add_adapters
from parallelkit.errors import ConfigError
from parallelkit.models import HFCausalLM

CONFIG = "moe.yaml"
QWEN3_MOE = yaml.safe_load((REPO / "configs" / CONFIG).read_text())["model"]["init_args"]["config"]
LORA = {"rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "experts.gate_up_proj", "experts.down_proj"]}
"""The MoE guide's adapters (its LoRA command), for the models built here."""
ONE_PROCESS = ("--trainer.strategy=auto", "--trainer.devices=1", "--data.init_args.batch_size=8")
LAYOUTS = MOE_LAYOUTS
"""The MoE guide's five layouts: [[2, 2], ["fsdp", "ep"]], [[4], ["ep"]], ep x tp, 1F1B pp x ep, ep x cp."""


@pytest.fixture(scope="module")
def pretrained_moe(tmp_path_factory):
    """A user's MoE directory: a random Qwen3-MoE of configs/moe.yaml's sizes (seed 7, not the runs'), saved by
    `save_pretrained`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("qwen3_moe")
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**QWEN3_MOE)).save_pretrained(directory)
    return directory


def finetune(pretrained) -> tuple[str, ...]:
    """The MoE guide's LoRA command's overrides (adapters on q, v and the experts of `pretrained`)."""
    command, flag, config, *overrides = parallelkit_args("moe-lora", 0, **{"/data/qwen3-moe": str(pretrained)})
    assert (command, flag, config) == ("fit", "--config", f"configs/{CONFIG}")
    return tuple(overrides)


@pytest.fixture(scope="module")
def peft_losses(tmp_path_factory, corpus, pretrained_moe):
    """transformers + PEFT in one process, `STEPS` steps, trained by Lightning (configs/moe.yaml's run otherwise): its
    per-step losses."""
    log = tmp_path_factory.mktemp("peft")
    peft = ("--model=models.PeftCausalLM", *finetune(pretrained_moe), "--trainer.callbacks=[]")  # no ExpertMonitor:
    # PEFT's wrapper is what the plan's experts name now, and it takes the experts' arguments otherwise
    assert_ok(fit(CONFIG, log, *common(corpus, log / "cache"), *peft, *ONE_PROCESS))
    return step_losses(log)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_on_the_experts_trains_as_peft_in_one_process(tmp_path, corpus, pretrained_moe, peft_losses, layout):
    """Adapters on q, v and on each expert's gate/up and down projections, on each of the MoE guide's layouts (each
    rank holding its experts' adapters as it holds them: whole on tp ranks, sharded over cp): per-step losses equal
    transformers + PEFT's in one process (fp32, 1e-5). The fsdp x ep run's last adapters, exported with `export-hf
    --adapters`, load into transformers with PEFT and give parallelkit's logits, and merged by `export-hf` give them
    too (1e-5). Its mid-run checkpoint (the adapters and their AdamW state, each expert's once) resumes on [[4],
    ["ep"]], each rank taking its experts' adapters: the next two steps are PEFT's too. A run started from the exported
    adapters (`lora.init_from`, in one process and on ep 4) holds them bit for bit; other ranks or targets are
    refused."""
    save = checkpoint_every(tmp_path / "ckpt", RESUME_AT)
    run = (*common(corpus, tmp_path / "cache"), *finetune(pretrained_moe))
    assert_ok(fit(CONFIG, tmp_path / "log", *run, *LAYOUTS[layout], save))
    assert_same_losses(peft_losses, step_losses(tmp_path / "log"))
    if layout != "fsdp_ep":
        return
    mid_run = tmp_path / "ckpt" / f"epoch=0-step={RESUME_AT}.ckpt"
    resume = (f"--ckpt_path={mid_run}", callback("models.StopAfter", step=RESUME_AT + 2))
    assert_ok(fit(CONFIG, tmp_path / "resumed", *run, *LAYOUTS["ep4"], *resume))
    resumed = step_losses(tmp_path / "resumed")
    assert sorted(resumed) == [RESUME_AT, RESUME_AT + 1]
    assert_same_losses({step: peft_losses[step] for step in resumed}, resumed)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from parallelkit.checkpoint import consolidate

    ckpt = tmp_path / "ckpt" / f"epoch=0-step={STEPS}.ckpt"
    place = {"runs/moe/version_0/checkpoints/epoch=0-step=200.ckpt": str(ckpt), "/data/qwen3-moe-adapter": "adapters"}
    assert_ok(parallelkit(*parallelkit_args("moe-lora", 1, **place), cwd=tmp_path))  # the guide's export
    assert_ok(parallelkit("export-hf", str(ckpt), str(tmp_path / "merged"), cwd=tmp_path))
    model = HFCausalLM(pretrained=str(pretrained_moe), lora=LORA)
    missing, unexpected = model.load_state_dict(
        torch.load(consolidate(ckpt, tmp_path / "a.pt"), weights_only=True), strict=False
    )
    assert not unexpected and all(not model.get_parameter(n).requires_grad for n in missing)
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["experts.gate_up_proj", "experts.down_proj"], config
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(pretrained_moe)
    with torch.no_grad():
        expected = model.eval()(tokens)
        untuned = base(tokens).logits
        by_peft = PeftModel.from_pretrained(base, tmp_path / "adapters").eval()(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(tokens).logits
    assert (expected - untuned).abs().max() > 1e-3  # the adapters changed the model: the comparison can fail
    torch.testing.assert_close(by_peft, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged, expected, rtol=1e-5, atol=1e-5)

    # Continuing the exported adapters (`lora.init_from`): in one process, and sharded on [[4], ["ep"]] (one step at
    # lr 0, saved: the adapters as they were read), parallelkit's adapters are the exported ones, bit for bit.
    exported = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    continued = HFCausalLM(pretrained=str(pretrained_moe), lora={**LORA, "init_from": str(tmp_path / "adapters")})
    assert all(torch.equal(p, exported[name]) for name, p in continued.named_parameters() if p.requires_grad)
    start = (f"--model.init_args.lora.init_from={tmp_path / 'adapters'}", "--model.init_args.lr=0")
    first = (callback("models.StopAfter", step=1), checkpoint_every(tmp_path / "continued", 1))
    assert_ok(fit(CONFIG, tmp_path / "continue", *run, *LAYOUTS["ep4"], *start, *first))
    read = torch.load(consolidate(tmp_path / "continued" / "epoch=0-step=1.ckpt", tmp_path / "c.pt"), weights_only=True)
    assert read.keys() == exported.keys() and all(torch.equal(read[k], exported[k]) for k in read)
    for lora, refusal in (
        ({**LORA, "rank": 8}, r"r=4, lora_alpha=8; this run's lora.rank=8, lora.alpha=8\. Fix: the same rank"),
        ({**LORA, "targets": ["q_proj", "v_proj"]}, r"holds .*experts.*which lora.targets does not adapt.*Fix:"),
    ):
        with pytest.raises(ConfigError, match=refusal):
            HFCausalLM(pretrained=str(pretrained_moe), lora={**lora, "init_from": str(tmp_path / "adapters")})


QWEN3_MOE_NF4 = {**QWEN3_MOE, "hidden_size": 128, "moe_intermediate_size": 128}
"""configs/moe.yaml's Qwen3-MoE with each expert's weights a multiple of 64 x 256 values (gate/up 256 x 128, down 128
x 128): NF4's standard scaler blocks (256 blocks of 64) fit each expert."""


@pytest.fixture(scope="module")
def pretrained_moe_nf4(tmp_path_factory):
    """A user's MoE directory of `QWEN3_MOE_NF4` (random, seed 7), saved by `save_pretrained`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("qwen3_moe_nf4")
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**QWEN3_MOE_NF4)).save_pretrained(directory)
    return directory


def test_qlora_on_the_experts_stores_each_expert_as_torchaos_nf4_and_trains_as_one_process(
    tmp_path, corpus, pretrained_moe_nf4
):
    """The MoE guide's QLoRA command (adapters on q, v and the experts, `quantize_base: nf4`) on [[2, 2], ["fsdp",
    "ep"]] with meta_init: each rank reads its experts' rows, quantizes them, and holds a quarter of every experts
    parameter's NF4 rows (its ep half, sharded over fsdp); gathered, each expert's row is torchao's `to_nf4(W[e], 64,
    256)` of the pretrained weight (codes, scales, factors, mean), and dequantizes to its `get_original_weight()`.
    Per-step losses equal one process's QLoRA (built eagerly, quantized at build; 1e-5)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    from transformers import AutoModelForCausalLM

    from parallelkit.adapters.nf4 import EXPERTS_SUFFIX, expert_nf4_parts, unpack_experts

    command, flag, config, *overrides = parallelkit_args("moe-qlora", 0, **{"/data/qwen3-moe": str(pretrained_moe_nf4)})
    assert (command, flag, config) == ("fit", "--config", f"configs/{CONFIG}")
    run = (*common(corpus, tmp_path / "cache"), *overrides)
    assert_ok(fit(CONFIG, tmp_path / "one", *run, *ONE_PROCESS))
    assert_ok(fit(CONFIG, tmp_path / "fsdp_ep", *run, callback("models.NF4Shards", out_dir="nf4")))
    assert_same_losses(step_losses(tmp_path / "one"), step_losses(tmp_path / "fsdp_ep"))

    ranks = [torch.load(tmp_path / "fsdp_ep" / "nf4" / f"rank{rank}.pt") for rank in range(4)]
    original = AutoModelForCausalLM.from_pretrained(pretrained_moe_nf4)
    stored = [name for name in ranks[0] if name.endswith(EXPERTS_SUFFIX)]
    assert len(stored) == 2 * QWEN3_MOE_NF4["num_hidden_layers"], sorted(ranks[0])
    experts = QWEN3_MOE_NF4["num_experts"]
    for name in stored:
        weight = original.get_parameter(name.removeprefix("model.").removesuffix(EXPERTS_SUFFIX)).detach()
        held = {rank[name]["first"]: rank[name]["rows"] for rank in ranks}
        assert {len(rows) for rows in held.values()} == {experts // 4}, name  # a quarter of the experts each
        rows = torch.cat([held[first] for first in sorted(held)])
        assert len(rows) == experts
        parts = expert_nf4_parts(rows, weight[0].numel(), weight.dtype)
        for expert in range(experts):
            reference = to_nf4(weight[expert], 64, 256)
            for key, value in parts.items():
                assert torch.equal(value[expert].reshape(getattr(reference, key).shape), getattr(reference, key))
            dequantized = unpack_experts(rows[expert : expert + 1], tuple(weight.shape[1:]), weight.dtype)[0]
            assert torch.equal(dequantized, reference.get_original_weight()), (name, expert)


def test_the_planner_fits_qwen3_30b_a3b_qlora_on_two_80gb_devices_where_lora_barely_fits():
    """The MoE guide's question: which layout fine-tunes Qwen3-30B-A3B (the preset's published architecture) with
    QLoRA on 2 x 80 GB? Rank-16 adapters on attention and the experts, the base in NF4: the planner counts each
    expert's weights at their stored size and recommends a layout that fits with most of the devices free; with
    LoRA on the fp32 base the same layout does not fit, and what fits holds the base's 4 bytes a parameter."""
    from parallelkit.adapters.lora import unquantized
    from parallelkit.adapters.nf4 import expert_nf4_bytes
    from parallelkit.memory import nf4_bytes
    from parallelkit.mesh import MeshSpec
    from parallelkit.planner import Hardware, Workload, recommend

    args = parallelkit_args("moe-qlora-plan")  # the guide's command: the sizes, and the adapters as it sets them
    assert args[:3] == ["plan", "--config", "configs/models/qwen3_30b_a3b.yaml"]
    assert [args[args.index(f"--{flag}") + 1] for flag in ("nodes", "devices-per-node", "device-memory")] == [
        "1",
        "2",
        "80GB",
    ]
    assert "--trainer.strategy.activation_checkpointing=full" in args
    prefix = "--model.init_args.lora."
    lora = {a.removeprefix(prefix).partition("=")[0]: yaml.safe_load(a.partition("=")[2]) for a in args if prefix in a}
    assert lora["quantize_base"] == "nf4"
    config = yaml.safe_load((REPO / "configs" / "models" / "qwen3_30b_a3b.yaml").read_text())["model"]["init_args"]
    work = Workload(seq_len=4096, micro_batch=4, compute_bytes=2, activation_checkpointing="full")
    hardware = Hardware(nodes=1, devices_per_node=2, device_memory=80e9)
    plans = {}
    for kind, quantize in (("lora", None), ("qlora", "nf4")):  # the QLoRA model last: counted below
        with torch.device("meta"):
            model = HFCausalLM(**config, lora={**lora, "quantize_base": quantize})
        plans[kind] = recommend(model, work, hardware)
    (_, best, _), (lora, _, _) = plans["qlora"], plans["lora"]
    assert best is not None and best.peak < 0.5 * 72e9, best
    same = next(e for e in lora if e.mesh == best.mesh and e.schedule == best.schedule)
    assert not same.fits and same.state > 3 * best.state
    # Each rank's share of: each expert's NF4 row, the attention's NF4 weights, the other frozen weights in fp32, and
    # the adapters with their gradients and AdamW moments (627M of them on the experts: 16 x 2 x 13M a layer).
    stored = {name: weight for name, weight in unquantized(model)}
    whole = sum(
        len(w) * expert_nf4_bytes(w[0].numel()) if w.dim() == 3 else nf4_bytes(w.numel()) for w in stored.values()
    )
    whole += sum((16 if p.requires_grad else 4) * p.numel() for n, p in model.named_parameters() if n not in stored)
    assert best.state == pytest.approx(whole / MeshSpec.parse(best.mesh).world_size, rel=1e-3)


@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_a_layers_adapted_experts_are_made_again_in_backward_not_kept_from_its_forward(monkeypatch, quantize):
    """LoRA (and QLoRA) on the experts, one process: what autograd keeps from the forward holds no full-precision
    copy of a layer's adapted (dequantized) experts: a ledger of the storages saved for backward counts, without the
    recipe, exactly those copies more (2 layers x gate/up + down, fp32). Backward makes each layer's again once, and
    the gradients are, bit for bit, those of keeping them."""
    from contextlib import nullcontext

    from parallelkit import lora_experts
    from parallelkit.memory import SavedTensorLedger

    made = []
    adapted = lora_experts._adapted
    monkeypatch.setattr(lora_experts, "_adapted", lambda *args: made.append(1) or adapted(*args))
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))

    def step() -> tuple[int, dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        model = HFCausalLM(QWEN3_MOE, lora={**LORA, "quantize_base": quantize})
        ledger = SavedTensorLedger()
        with torch.autograd.graph.saved_tensors_hooks(ledger.pack, ledger.unpack):
            loss = model.pipeline_loss(model(tokens[:, :-1]), tokens[:, 1:])
        held = ledger.live
        made.clear()
        loss.backward()
        return held, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    held, grads = step()
    layers, experts = QWEN3_MOE["num_hidden_layers"], QWEN3_MOE["num_experts"]
    assert len(made) == 2 * layers  # once per adapted parameter and layer, in backward
    monkeypatch.setattr(lora_experts, "_made_again_in_backward", lambda _: nullcontext())
    kept, kept_grads = step()
    hidden, inner = QWEN3_MOE["hidden_size"], QWEN3_MOE["moe_intermediate_size"]
    assert kept - held == layers * experts * (2 * inner * hidden + hidden * inner) * 4
    assert made == [] and grads.keys() == kept_grads.keys()
    assert all(torch.equal(grads[name], kept_grads[name]) for name in grads)


def test_adapters_go_on_each_experts_parameter_and_what_cannot_be_adapted_is_named():
    """`mlp.experts.gate_up_proj` adapts every layer's stacked gate/up parameter [E, 2I, H]: A [E, r, H], B [E, 2I, r]
    beside it, trainable, the base frozen; the experts module named instead, dropout, an expert too small for NF4's
    blocks under a 4-bit base, and a 3-D parameter of a module that does not follow the experts contract are refused
    naming the fix."""
    model = HFCausalLM(QWEN3_MOE, lora=LORA)
    assert expert_parameters(model)[:2] == [
        "model.model.layers.0.mlp.experts.gate_up_proj",
        "model.model.layers.0.mlp.experts.down_proj",
    ]
    experts = model.model.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj_lora_A.shape) == (8, 4, 64) and tuple(experts.gate_up_proj_lora_B.shape) == (
        8,
        64,
        4,
    )
    assert not experts.gate_up_proj.requires_grad and experts.down_proj_lora_A.requires_grad
    assert experts.gate_up_proj_lora_B.abs().sum() == 0 and experts.gate_up_proj_lora_A.abs().sum() > 0
    for lora, expected in (
        (
            {**LORA, "targets": ["experts"]},
            r"adapters go on torch.nn.Linear layers and on experts' stacked parameters.*mlp.experts.gate_up_proj",
        ),
        ({**LORA, "dropout": 0.1}, r"adapters on experts' parameters take no dropout.*Fix: lora.dropout: 0"),
    ):
        with pytest.raises(ConfigError, match=expected):
            add_adapters(HFCausalLM(QWEN3_MOE), lora)
    odd = {**QWEN3_MOE, "hidden_size": 40, "moe_intermediate_size": 20}  # down_proj: 800 values an expert
    with pytest.raises(
        ConfigError, match=r"experts.down_proj \(\(8, 40, 20\): 800 values an expert\) cannot be stored as NF4"
    ):
        HFCausalLM(odd, lora={**LORA, "quantize_base": "nf4"})

    class Stacked(torch.nn.Module):  # a stack of 4 matrices, but no experts module: no num_experts
        def __init__(self) -> None:
            super().__init__()
            self.mixer = torch.nn.Parameter(torch.zeros(4, 8, 8))

    with pytest.raises(ConfigError, match=r"names mixer \[4, 8, 8\] of Stacked, which is not an experts param.*Fix:"):
        add_adapters(Stacked(), {"targets": ["mixer"]})
