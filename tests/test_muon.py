"""Muon (`--optimizer=torch.optim.Muon`, run as `parallelkit.Muon`): torch's Muon on the hidden matrices, each
orthogonalised whole once a step by one of the ranks that share it, and AdamW on the rest. The reference is torch's
own `torch.optim.Muon` and `torch.optim.AdamW` in one process (`models.TorchMuon`, on the same split).

Two checks per run. Over 20 steps at torch's defaults, every step's loss equals one process's within 1e-5. And
given the gradients the layout itself reduced (`models.RecordedSteps`), torch's optimizers in this process give the
layout's parameters bit for bit: the optimizer's exactness, free of the gradients' reduction order. The first holds
at moderate step sizes only: the ~1e-7 by which a layout's reduced gradients differ from one process's is amplified
by large steps, by Muon's bf16 Newton-Schulz more than by AdamW (at lr 0.02 both drift by ~2e-3 over 20 steps: the
guide's "How exact")."""

import pytest
import torch
import yaml
from models import TorchOptimizers
from snippets import parallelkit_args, snippet
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

from parallelkit.errors import ConfigError
from parallelkit.models import GPT, HFCausalLM
from parallelkit.optimizers.muon import Muon, hidden_matrices

COMMAND, FLAG, GUIDE_CONFIG, *GUIDE = parallelkit_args("muon-fit")  # the guide's command (docs/guides/muon.md)
OURS = tuple(GUIDE)  # torch's name and defaults, as users write it, run as parallelkit.Muon
REFERENCE = ("--optimizer=models.TorchMuon", *OURS[1:])
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
]


def run(tmp_path_factory, corpus, config, *overrides, recorded=(0, 1, 2), resumed=False, steps=STEPS):
    """A run's log; `resumed`: the run a test resumes, which saves a checkpoint at RESUME_AT."""
    log = tmp_path_factory.mktemp(config.removesuffix(".yaml"))
    steps = common(corpus, log / "cache", steps=steps)
    record = callback("models.RecordedSteps", out_dir="steps", steps=list(recorded))
    checkpoint = (checkpoint_every(log / "ckpt", RESUME_AT),) if resumed else ()
    assert_ok(fit(config, log, *steps, record, *checkpoint, *overrides))
    return log


def recorded(log, step: int) -> dict:
    """What a run's ranks recorded just before `step` (`models.RecordedSteps`), put together: each parameter's whole
    value and gradient (a pipeline rank holds its stage's), Muon's matrices, the optimizer's settings."""
    together: dict = {"params": {}, "grads": {}, "matrices": set()}
    paths = sorted((log / "steps").glob(f"step{step}_rank*.pt"))
    assert paths, f"nothing recorded at step {step} under {log}"
    for path in paths:
        record = torch.load(path)
        together["params"].update(record["params"])
        together["grads"].update(record["grads"])
        together["matrices"].update(record["matrices"])
        together["group"] = record["group"]
    return together


def replayed(steps: list[dict]) -> dict[str, torch.Tensor]:
    """torch's own optimizers in this process (`models.TorchOptimizers`), from the parameters recorded at the first
    of `steps`, fed each step's recorded gradients: the parameters they give."""
    params = {name: torch.nn.Parameter(value.clone()) for name, value in steps[0]["params"].items()}
    matrices = [param for name, param in params.items() if name in steps[0]["matrices"]]
    rest = [param for name, param in params.items() if name not in steps[0]["matrices"]]
    optimizers = TorchOptimizers(matrices, rest, steps[0]["group"])
    for step in steps:
        for name, param in params.items():
            param.grad = step["grads"][name]
        optimizers.step(step["group"])
    return {name: param.detach() for name, param in params.items()}


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
            made[config] = run(tmp_path_factory, corpus, config, *REFERENCE, *ONE_PROCESS, recorded=())
        return made[config]

    return get


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, corpus):
    made = {}

    def get(config: str, layout: str):
        if (config, layout) not in made:
            resumed = (config, layout) == ("hybrid.yaml", "fsdp_tp")  # it records every step to the resume's last
            steps = range(RESUME_AT + 3) if resumed else (0, 1, 2)
            made[config, layout] = run(
                tmp_path_factory, corpus, config, *OURS, *LAYOUTS[layout], recorded=steps, resumed=resumed
            )
        return made[config, layout]

    return get


def test_the_guides_command_is_the_one_run_here():
    assert (COMMAND, FLAG, GUIDE_CONFIG) == ("fit", "--config", "configs/hybrid.yaml")
    assert OURS == ("--optimizer=torch.optim.Muon",)


@pytest.mark.parametrize(("config", "layout"), RUNS)
def test_muon_steps_equal_torchs_muon_and_adamw_in_one_process(torch_muon, layouts, config, layout):
    """Every step's loss equals one process's (torch's optimizers) within 1e-5 over 20 steps; and torch's optimizers
    fed the layout's own reduced gradients for two steps give the layout's parameters bit for bit (Muon's momentum
    and Nesterov, the whole-matrix orthogonalisation, the learning rate adjusted by the whole matrix's shape, the
    weight decay; AdamW on the rest)."""
    reference, ours = torch_muon(config), layouts(config, layout)
    assert_same_losses(step_losses(reference), step_losses(ours))
    steps = [recorded(ours, step) for step in (0, 1, 2)]
    assert steps[0]["matrices"]
    assert_bit_for_bit(replayed(steps[:2]), steps[2]["params"])


def test_lora_adapters_with_accumulation_take_torchs_updates(tmp_path_factory, corpus):
    """LoRA on the Llama on fsdp x tp (the adapters, Muon's matrices, tp-sharded with their layers), gradients
    accumulated over 2 micro-batches, Moonshot's learning-rate adjustment (`match_rms_adamw`: 0.2 x sqrt(max(rows,
    columns))): torch's optimizers fed the layout's reduced gradients give its adapters bit for bit. (Its losses
    against one process accumulating the same rows: 3.6e-6 over 20 steps, by hand.)"""
    options = ("--optimizer.adjust_lr_fn=match_rms_adamw", "--trainer.accumulate_grad_batches=2")
    log = run(tmp_path_factory, corpus, "lora.yaml", *OURS, *options, "--data.init_args.batch_size=2", steps=3)
    steps = [recorded(log, step) for step in (0, 1, 2)]
    assert steps[0]["group"]["adjust_lr_fn"] == "match_rms_adamw"
    assert sorted(steps[0]["matrices"]) == sorted(steps[0]["params"]) and all("lora_" in n for n in steps[0]["params"])
    assert_bit_for_bit(replayed(steps[:2]), steps[2]["params"])


def test_a_checkpoint_resumes_in_another_layout_exactly(tmp_path, corpus, layouts):
    """The fsdp x tp run's mid-run checkpoint (momentum buffers and AdamW moments, fsdp x tp shards) resumed on HSDP
    [[2, 1, 2], ["replicate", "fsdp", "tp"]] (the state whole on each replica's tp ranks): torch's optimizers fed the
    uninterrupted run's gradients to that step, then the resumed run's, give the resumed run's parameters two steps
    later bit for bit (as they give the uninterrupted run's), and every step's loss to the end is the uninterrupted
    run's within 1e-6 (measured: equal). A layout that sums the gradients in another order drifts as in the test above:
    resumed on [[4], ["fsdp"]], the same replay holds bit for bit and the losses part by 3.9e-6 by step 20 (by
    hand)."""
    straight = layouts("hybrid.yaml", "fsdp_tp")
    record = callback("models.RecordedSteps", out_dir="steps", steps=[RESUME_AT, RESUME_AT + 1, RESUME_AT + 2])
    hsdp = '--trainer.strategy.mesh_shape=[[2, 1, 2], ["replicate", "fsdp", "tp"]]'
    resume = (f"--ckpt_path={straight / 'ckpt' / f'epoch=0-step={RESUME_AT}.ckpt'}", *OURS, hsdp, record)
    assert_ok(fit("hybrid.yaml", tmp_path, *common(corpus, tmp_path / "cache", steps=STEPS), *resume))
    before = [recorded(straight, step) for step in range(RESUME_AT + 3)]
    after = [recorded(tmp_path, step) for step in range(RESUME_AT, RESUME_AT + 3)]
    assert_bit_for_bit(replayed(before[:-1]), before[-1]["params"])
    assert_bit_for_bit(replayed(before[:RESUME_AT] + after[:-1]), after[-1]["params"])
    expected, resumed = step_losses(straight), step_losses(tmp_path)
    assert sorted(resumed) == list(range(RESUME_AT, STEPS))
    assert_same_losses({step: expected[step] for step in resumed}, resumed, rtol=1e-6)


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


def test_torchs_name_takes_parallelkits_options_and_a_config_naming_torchs_class_is_told_which(tmp_path):
    """`--optimizer=torch.optim.Muon --optimizer.adamw_lr=...` (the guide lists `adamw_lr` right after saying torch's
    name runs as parallelkit's) is parallelkit.Muon with that option; a config file whose class_path is torch's and
    sets `adamw_lr` is refused naming the class that takes it."""
    from parallelkit.cli.lightning_cli import torch_muon_as_ours

    for given in (["--optimizer=torch.optim.Muon"], ["--optimizer", "torch.optim.Muon"]):
        assert "parallelkit.Muon" in torch_muon_as_ours([*given, "--optimizer.adamw_lr=0.001"])[len(given) - 1]
    printed = parallelkit(
        "fit",
        "--config",
        str(REPO / "configs/hybrid.yaml"),
        *OURS,
        "--optimizer.adamw_lr=0.001",
        "--print_config",
        cwd=tmp_path,
    )
    assert_ok(printed)
    optimizer = yaml.safe_load(printed.stdout)["optimizer"]
    assert optimizer["class_path"] == "parallelkit.Muon" and optimizer["init_args"]["adamw_lr"] == 0.001

    config = tmp_path / "muon.yaml"
    config.write_text(
        yaml.safe_dump({"optimizer": {"class_path": "torch.optim.Muon", "init_args": {"adamw_lr": 1e-3}}})
    )
    refused = parallelkit("fit", "--config", str(REPO / "configs/hybrid.yaml"), "--config", str(config), cwd=tmp_path)
    assert refused.returncode != 0
    message = " ".join(refused.stderr.split())
    assert "adamw_lr is an option of parallelkit.Muon, which runs torch.optim.Muon" in message, message[-2000:]
    assert "Fix: class_path: parallelkit.Muon" in message and "Traceback" not in refused.stderr
