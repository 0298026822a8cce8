"""Muon (`--optimizer=torch.optim.Muon`, run as `parallelkit.Muon`): torch's Muon on the hidden matrices, each
orthogonalised whole once a step by one of the ranks that share it, and AdamW on the rest. The reference is torch's
own `torch.optim.Muon` and `torch.optim.AdamW` in one process (`models.TorchMuon`, on the same split).

Per-step losses cannot show Muon's exactness beyond the first steps: torch's Newton-Schulz runs in bf16, and the
1e-7 by which a layout's reduced gradients differ from one process's (the sums' order) flips bf16 roundings that
the iteration amplifies (in one process, gradients perturbed by 1e-7 move the loss by up to 7e-5 within 8 steps).
So each run is also given the same gradients in every layout for two steps (`models.InjectedGradients`), after
which every parameter must equal the reference's bit for bit; then it trains on its own gradients."""

import pytest
import torch
import yaml
from snippets import parallelkit_args, snippet
from support import REPO, assert_ok, assert_same_losses, callback, checkpoint_every, common, fit, step_losses

from parallelkit.errors import ConfigError
from parallelkit.models import GPT, HFCausalLM
from parallelkit.muon import Muon, hidden_matrices

COMMAND, FLAG, GUIDE_CONFIG, *GUIDE = parallelkit_args("muon-fit")  # the guide's command (docs/guides/muon.md)
OURS = tuple(GUIDE)  # torch's name, as users write it, run as parallelkit.Muon; one lr for both parts
REFERENCE = ("--optimizer=models.TorchMuon", *OURS[1:])
STEPS = 8
INJECTED = callback("models.InjectedGradients", out_dir="params", steps=[0, 1, 4, 5], save_at=[2, 6])
"""The same gradients in every layout at steps 0, 1 (and 4, 5: after a resume from step 4); parameters saved at 2
and 6."""
ONE_PROCESS = ("--trainer.strategy=auto", "--trainer.devices=1", "--data.init_args.batch_size=8")
LAYOUTS = {
    "fsdp_tp": (),  # the configs' own [[2, 2], ["fsdp", "tp"]] (moe.yaml's [[2, 2], ["fsdp", "ep"]])
    "fsdp4": ('--trainer.strategy.mesh_shape=[[4], ["fsdp"]]', "--data.init_args.batch_size=2"),
    "1f1b_pp2_fsdp2": (
        "--trainer.strategy=parallelkit.PipelineStrategy",
        '--trainer.strategy.mesh_shape=[[2, 2], ["pp", "fsdp"]]',
        "--trainer.strategy.schedule=1f1b",
        "--trainer.devices=4",
    ),
}
RUNS = [
    *((config, layout) for config in ("hybrid.yaml", "hf_llama.yaml") for layout in LAYOUTS),  # GPT, HF Llama
    ("moe.yaml", "fsdp_tp"),  # Qwen3-MoE on [[2, 2], ["fsdp", "ep"]]: the experts a matrix each
    ("lora.yaml", "fsdp_tp"),  # LoRA adapters on a Llama: Muon's matrices, tp-sharded as their layers
]


def run(tmp_path_factory, corpus, config: str, *overrides: str):
    log = tmp_path_factory.mktemp(config.removesuffix(".yaml"))
    steps = common(corpus, log / "cache", steps=STEPS)
    assert_ok(fit(config, log, *steps, INJECTED, checkpoint_every(log / "ckpt", 4), *overrides))
    return log


def parameters(log, step: int) -> dict[str, torch.Tensor]:
    """Every parameter's whole value at the start of `step`, from each rank's file (pipeline ranks hold theirs)."""
    held: dict[str, torch.Tensor] = {}
    for path in sorted((log / "params").glob(f"step{step}_rank*.pt")):
        held.update(torch.load(path))
    return held


def assert_bit_for_bit(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    different = [name for name in expected if not torch.equal(expected[name], actual[name])]
    assert not different, [(n, (expected[n] - actual[n]).abs().max().item()) for n in different[:5]]


@pytest.fixture(scope="module")
def torch_muon(tmp_path_factory, corpus):
    """`torch.optim.Muon` + `torch.optim.AdamW` in one process, per config: its run's log."""
    made = {}

    def get(config: str):
        if config not in made:
            made[config] = run(tmp_path_factory, corpus, config, *REFERENCE, *ONE_PROCESS)
        return made[config]

    return get


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, corpus):
    made = {}

    def get(config: str, layout: str):
        if (config, layout) not in made:
            made[config, layout] = run(tmp_path_factory, corpus, config, *OURS, *LAYOUTS[layout])
        return made[config, layout]

    return get


def test_the_guides_command_is_the_one_run_here():
    assert (COMMAND, FLAG, GUIDE_CONFIG) == ("fit", "--config", "configs/hybrid.yaml")
    assert OURS[0] == "--optimizer=torch.optim.Muon"


@pytest.mark.parametrize(("config", "layout"), RUNS)
def test_muon_steps_equal_torchs_muon_and_adamw_in_one_process(torch_muon, layouts, config, layout):
    """Given the same gradients (steps 0 and 1), every parameter after two steps equals torch's optimizers' in one
    process bit for bit (Muon's momentum and Nesterov, the whole-matrix orthogonalisation, the learning rate adjusted
    by the whole matrix's shape, the weight decay; AdamW on the rest); the losses to step 2 to 1e-5, and after that,
    on the layout's own gradients, within the bf16 iteration's amplification of their 1e-7 (2e-3 over 8 steps)."""
    reference, ours = torch_muon(config), layouts(config, layout)
    assert_bit_for_bit(parameters(reference, 2), parameters(ours, 2))
    expected, actual = step_losses(reference), step_losses(ours)
    assert_same_losses({s: expected[s] for s in range(3)}, {s: actual[s] for s in range(3)})
    assert_same_losses(expected, actual, rtol=2e-3)


def test_a_checkpoint_resumes_in_another_layout_with_the_same_updates(tmp_path, corpus, layouts):
    """The fsdp x tp run's step-4 checkpoint (momentum buffers and AdamW moments, sharded) resumed on [[4],
    ["fsdp"]], its gradients accumulated over 2 micro-batches: given the same gradients at steps 4 and 5, every
    parameter at step 6 equals the uninterrupted run's bit for bit."""
    saved = layouts("hybrid.yaml", "fsdp_tp")
    accumulated = ("--trainer.accumulate_grad_batches=2", "--data.init_args.batch_size=1")
    resume = (f"--ckpt_path={saved / 'ckpt' / 'epoch=0-step=4.ckpt'}", *OURS, *LAYOUTS["fsdp4"], *accumulated, INJECTED)
    assert_ok(fit("hybrid.yaml", tmp_path, *common(corpus, tmp_path / "cache", steps=7), *resume))
    assert_bit_for_bit(parameters(saved, 6), parameters(tmp_path, 6))


def test_the_rule_takes_linear_weights_and_experts_and_one_process_is_torchs_own():
    """Muon takes the blocks' linear weights; the embedding, norms and the output layer go to AdamW; a Qwen3-MoE's
    experts' stacked parameters are Muon's too (its routers, no linear layers, AdamW's), LoRA's adapters (dense and
    experts') alone when they are what trains. One process: three steps equal torch's `Muon` and `AdamW`, bit for
    bit. Given bare parameters and no strategy, it refuses at its first step, saying how to give them their names."""
    torch.manual_seed(0)
    sizes = {"vocab_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 32}
    ours, theirs = GPT(**sizes), GPT(**sizes)
    theirs.load_state_dict(ours.state_dict())
    names = hidden_matrices(ours)
    blocks = ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.up", "mlp.down")
    assert names == [f"blocks.{b}.{w}.weight" for b in (0, 1) for w in blocks]
    optimizer = Muon(ours, lr=0.02, adjust_lr_fn="match_rms_adamw")
    assert optimizer.muon_parameters() == names
    matrices = [p for n, p in theirs.named_parameters() if n in names]
    rest = [p for n, p in theirs.named_parameters() if n not in names]
    reference = (
        torch.optim.Muon(matrices, lr=0.02, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=0.02, weight_decay=0.1),
    )
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for model in (ours, theirs):
            model.pipeline_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        for each in (optimizer, *reference):
            each.step()
            each.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))

    moe = yaml.safe_load((REPO / "configs" / "moe.yaml").read_text())["model"]["init_args"]["config"]
    chosen = hidden_matrices(HFCausalLM(moe))
    layer = "model.model.layers.0"
    assert f"{layer}.mlp.experts.gate_up_proj" in chosen and f"{layer}.mlp.experts.down_proj" in chosen
    assert f"{layer}.mlp.gate.weight" not in chosen  # transformers' router is no linear layer: AdamW's
    assert not any(name.endswith(("embed_tokens.weight", "lm_head.weight", "norm.weight")) for name in chosen)
    lora = {"rank": 4, "targets": ["q_proj", "experts.gate_up_proj"]}
    assert hidden_matrices(HFCausalLM(moe, lora=lora)) == [
        f"model.model.layers.{i}.{part}" for i in (0, 1) for part in (
            "self_attn.q_proj.lora_A", "self_attn.q_proj.lora_B",
            "mlp.experts.gate_up_proj_lora_A", "mlp.experts.gate_up_proj_lora_B",
        )
    ]  # fmt: skip

    scope: dict = {}
    exec(snippet("muon-python").text, scope)  # the guide's module: Muon on its linear layers, AdamW on the rest
    guide = scope["MyModel"]().configure_optimizers()
    assert guide.muon_parameters() == ["hidden.weight", "head.weight"]

    bare = Muon(ours.parameters())
    ours.pipeline_loss(ours(tokens[:, :-1]), tokens[:, 1:]).backward()
    with pytest.raises(ConfigError, match=r"does not know which parameters are matrices.*Fix: Muon\(self"):
        bare.step()
