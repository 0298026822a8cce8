"""QLoRA (`lora.quantize_base: nf4`): the adapted layers' frozen weights stored as torchao NF4 tensors, sharded by
FSDP2 as 4-bit data, in pipelines; losses per step equal one process's running the same quantization; close to, and
not equal to, LoRA on the unquantized base; checkpoints of adapters that resume in another layout; exports."""

import sys
from types import SimpleNamespace

import pytest
import torch
from models import TINY_LLAMA
from snippets import parallelkit_args
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

from parallelkit.adapters.lora import quantized_names
from parallelkit.adapters.nf4 import BLOCK, SCALER_BLOCK, quantization_scaler_block, scaler_block_size
from parallelkit.checkpoint import consolidate
from parallelkit.errors import ConfigError, PlanError
from parallelkit.memory import nf4_bytes
from parallelkit.models import HFCausalLM
from parallelkit.models.hf_export import export_hf
from parallelkit.parallel import resolve
from parallelkit.strategies import FSDPTPStrategy

CONFIG = "qlora.yaml"
"""A Llama (hidden 128: NF4 blocks fit) with rank-8 adapters on attention and MLP, its base in NF4, FSDP2 over 4."""

LLAMA = {**TINY_LLAMA, "hidden_size": 128, "intermediate_size": 256}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QLORA = {"rank": 8, "alpha": 16.0, "targets": TARGETS, "quantize_base": "nf4"}
ONE_PROCESS = ("--trainer.strategy=auto", "--trainer.devices=1", "--data.init_args.batch_size=8")
META = "--trainer.strategy.meta_init=true"  # each base weight read from the directory and quantized alone
NF4_SHARDS = callback("models.NF4Shards", out_dir="nf4")  # each rank's shards of the NF4 weights, under the run's log
README = (META, FIRST_BATCH, NF4_SHARDS)  # the README's QLoRA command on a user's model (from_base), observed
PIPELINE = (
    "--trainer.strategy=parallelkit.PipelineStrategy",
    '--trainer.strategy.mesh_shape=[[2], ["pp"]]',
    "--trainer.strategy.schedule=1f1b",
    "--trainer.devices=2",
    "--data.init_args.batch_size=8",
    META,
)


@pytest.fixture(scope="module")
def pretrained(pretrained_llama):
    """A user's model directory: the Llama (hidden 128) and its own tokenizer."""
    return pretrained_llama("qlora", hidden_size=LLAMA["hidden_size"], intermediate_size=LLAMA["intermediate_size"])


def from_base(pretrained, *overrides: str) -> tuple[str, ...]:
    """The guide's command for a user's own model (docs/guides/lora-qlora.md): its directory, its tokenizer on the
    text. The text is the suite's corpus, which `reference` gives after these."""
    return guide_command("qlora-finetune", "configs/qlora.yaml", pretrained, *overrides)


def test_qlora_on_fsdp4_matches_one_process_and_its_checkpoint_resumes_in_a_pipeline(reference, pretrained):
    """[[4], ["fsdp"]] (NF4 weights sharded, all-gathered as 4-bit data) equals one process per step; the run's
    mid-run adapters resumed under 1F1B pp=2 give one process's next steps (20 steps of 1F1B from the start: 1.7e-7
    by hand)."""
    expected = reference(CONFIG, *from_base(pretrained, *ONE_PROCESS)).losses()
    fsdp = reference(CONFIG, *from_base(pretrained, *README))
    assert_same_losses(expected, fsdp.losses())
    resumed = reference(CONFIG, *from_base(pretrained, *PIPELINE, f"--ckpt_path={fsdp.checkpoint}")).losses()
    assert sorted(resumed) == list(range(RESUME_AT, STEPS))
    assert_same_losses({step: expected[step] for step in resumed}, resumed)


def test_qlora_trains_in_bf16_true_on_fsdp_x_cp_close_to_fp32(tmp_path, corpus, reference, pretrained):
    """The guide's QLoRA command in bf16-true (the NF4 base dequantized to bf16, the adapters bf16) with the sequences
    split over cp: QLoRA's and cp's bf16 run, the global batch of the fp32 run above; within 2% of its losses (measured:
    3e-4 over 6 steps), and not equal to them."""
    layout = ('--trainer.strategy.mesh_shape=[[2, 2], ["fsdp", "cp"]]', "--data.init_args.batch_size=4")
    bf16 = (*layout, "--trainer.precision=bf16-true")
    assert_ok(fit(CONFIG, tmp_path, *common(corpus, tmp_path / "cache", steps=6), *from_base(pretrained, META, *bf16)))
    fp32, losses = reference(CONFIG, *from_base(pretrained, *README)).losses(), step_losses(tmp_path)
    assert_same_losses({step: fp32[step] for step in losses}, losses, rtol=0.02)
    assert max(abs(losses[s] - fp32[s]) / fp32[s] for s in losses) > 1e-5


def test_the_guides_command_feeds_a_users_model_its_own_tokenizer(reference, pretrained, corpus):
    """The guide's QLoRA command on a user's `save_pretrained` directory: the first batch is its tokenizer's ids."""
    assert_own_tokenizer(reference(CONFIG, *from_base(pretrained, *README)).log, pretrained, corpus, seq_len=64)


def test_qlora_is_close_to_lora_on_the_unquantized_base_and_not_equal(reference, pretrained):
    """The same run with the base in fp32: losses close at every step (measured over 20 steps: at most 0.27% apart, at
    step 8, the median step 0.053%) and not equal (the base really is quantized: the median step 5e-4 apart)."""
    qlora = reference(CONFIG, *from_base(pretrained, *ONE_PROCESS)).losses()
    lora = reference(CONFIG, *from_base(pretrained, *ONE_PROCESS, "--model.init_args.lora.quantize_base=null"))
    gaps = [abs(qlora[step] - loss) / loss for step, loss in lora.losses().items()]
    median = sorted(gaps)[len(gaps) // 2]
    assert max(gaps) < 3e-2 and 1e-4 < median < 5e-3


def test_exports_load_in_peft_and_transformers_within_the_quantization_error(tmp_path, reference, pretrained):
    """The fsdp run's mid-run adapters: `--adapters` (PEFT's format) on the unquantized base equals the merged export
    (which merges into the fp32 weights read from `pretrained`); both differ from parallelkit's QLoRA model by the
    base's quantization error only (peft cannot put adapters on torchao's NF4 base: it quantizes with bitsandbytes)."""
    from peft import PeftModel

    ckpt = reference(CONFIG, *from_base(pretrained, *README)).checkpoint
    # The guide's two exports: the first as the command, in a fresh interpreter, where torchao (which transformers
    # imports) speaks: it prints its result and nothing else; the second in this process (the same function).
    place = {
        "runs/qlora/checkpoints/last.ckpt": str(ckpt),  # its mid-run checkpoint
        "/data/my-adapter": str(tmp_path / "adapters"),
        "/data/Llama-3.2-1B-merged": str(tmp_path / "merged"),
    }
    first = parallelkit_args("qlora-finetune", 1, **place)
    assert first[0] == "export-hf" and first[3:] == ["--adapters"]
    proc = parallelkit(*first, cwd=tmp_path, real_launch=True, PYTHONWARNINGS="")
    assert_ok(proc)
    assert proc.stdout.startswith(f"wrote {tmp_path / 'adapters'}") and not proc.stderr, proc.stdout + proc.stderr
    command, source, target, *flags = parallelkit_args("qlora-finetune", 2, **place)
    assert command == "export-hf" and not flags
    export_hf(source, target)
    model = HFCausalLM(pretrained=str(pretrained), lora=QLORA)  # its adapters from the checkpoint, consolidated
    adapters = torch.load(consolidate(ckpt, tmp_path / "adapters.pt"), weights_only=True)
    missing, unexpected = model.load_state_dict(adapters, strict=False)
    assert not unexpected and all(not model.get_parameter(n).requires_grad for n in missing)
    tokens = torch.randint(0, LLAMA["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(pretrained)
    with torch.no_grad():
        untuned = base(tokens).logits
        by_peft = PeftModel.from_pretrained(base, tmp_path / "adapters").eval()(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(tokens).logits
        ours = model.eval()(tokens)
    torch.testing.assert_close(merged, by_peft, rtol=1e-5, atol=1e-5)
    assert (merged - untuned).abs().max() > 1e-3  # the adapters trained
    error = (merged - ours).abs().max().item()
    assert 1e-4 < error < 0.5, error  # the base's quantization error (README: the merged export's error)


def assert_torchaos_nf4(stored: dict, weight: torch.Tensor) -> None:
    """`stored` (an NF4 weight's codes, per-block scales, scaler factors and mean) holds torchao's `to_nf4(weight, 64,
    256)`: the same codes, scales and mean, each 256-block scaler factor repeated over the stored split of its block
    (for a weight whose blocks 256 does not divide, torchao's with the largest scaler block that does)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    size = quantization_scaler_block(weight.numel())
    reference = to_nf4(weight.detach(), BLOCK, size)
    for key in ("quantized_data", "quantized_scalers", "scaler_mean"):
        assert torch.equal(stored[key], getattr(reference, key)), key
    split = size // scaler_block_size(weight.numel())
    assert torch.equal(stored["quantization_factor"], reference.quantization_factor.repeat_interleave(split))


def test_the_base_is_torchaos_standard_nf4_half_a_byte_per_parameter_plus_scales(pretrained):
    """Every adapted layer's base is torchao's `to_nf4(w, 64, 256)` of the pretrained weight (the standard QLoRA
    base, as bitsandbytes' and torchao's defaults make it; the Llama's k/v projections, 128 blocks, take 128), its
    scaler blocks stored in a count 8 divides (2, 4 or 8 equal shards): dequantized, the weight torchao's gives."""
    model = HFCausalLM(pretrained=str(pretrained), lora=QLORA)
    original = AutoModelForCausalLM.from_pretrained(pretrained)
    names = quantized_names(model)
    assert len(names) == LLAMA["num_hidden_layers"] * len(TARGETS)
    sizes = {}
    for name in names:
        weight = model.get_parameter(name)
        stored = sum(
            getattr(weight, inner).numel() * getattr(weight, inner).element_size()
            for inner in weight.__tensor_flatten__()[0]
        )
        assert stored == nf4_bytes(weight.numel())
        assert stored <= 1.1 * (weight.numel() / 2 + weight.numel() / BLOCK)  # codes + a byte-sized scale per block
        assert (weight.numel() // BLOCK // scaler_block_size(weight.numel())) % 8 == 0  # 2, 4 or 8 equal shards
        base = original.get_parameter(name.removeprefix("model."))
        inner = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")
        assert_torchaos_nf4({key: getattr(weight, key) for key in inner}, base)
        sizes[name.split(".")[-2]] = quantization_scaler_block(weight.numel())
    assert sizes == {**dict.fromkeys(TARGETS, SCALER_BLOCK), "k_proj": 128, "v_proj": 128}


SHARDED = ("quantized_data", "quantized_scalers", "quantization_factor")
"""An NF4Tensor's inner tensors FSDP2 shards by rows (its scaler mean is one value every shard holds)."""


def test_each_fsdp_ranks_nf4_shards_gather_into_torchaos_standard_nf4(reference, pretrained):
    """On [[4], ["fsdp"]] (the README's QLoRA command), each rank holds a quarter of every NF4 weight's codes, scales
    and factors; gathered in rank order they are torchao's `to_nf4(w, 64, 256)` of the pretrained weight."""
    log = reference(CONFIG, *from_base(pretrained, *README)).log
    ranks = [torch.load(log / "nf4" / f"rank{rank}.pt") for rank in range(4)]
    original = AutoModelForCausalLM.from_pretrained(pretrained)
    assert sorted(ranks[0]) == sorted(quantized_names(HFCausalLM(pretrained=str(pretrained), lora=QLORA)))
    for name, shard in ranks[0].items():
        parts = [rank[name] for rank in ranks]
        for key in SHARDED:
            assert len({part[key].numel() for part in parts}) == 1, (name, key)  # equal shards
        gathered = {key: torch.cat([part[key] for part in parts]) for key in SHARDED}
        gathered["scaler_mean"] = shard["scaler_mean"]  # a scalar every shard holds whole
        assert_torchaos_nf4(gathered, original.get_parameter(name.removeprefix("model.")))


def test_tensor_parallelism_and_a_meta_base_without_values_and_a_missing_torchao_are_refused_with_the_fix(
    pretrained, monkeypatch
):
    model = HFCausalLM(pretrained=str(pretrained), lora=QLORA)
    with pytest.raises(PlanError, match="NF4Tensors, which torch's tensor-parallel styles cannot split.*Fix:"):
        resolve(model, tp=2)
    on_meta = HFCausalLM(config={"model_type": "llama", **LLAMA}, lora=QLORA)
    for _, module in on_meta.named_modules():
        if hasattr(module, "quantize_base"):
            module.weight = torch.nn.Parameter(torch.empty_like(module.weight, device="meta"), requires_grad=False)
    strategy = SimpleNamespace(lightning_module=on_meta, root_device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="meta_init needs each base weight's values.*Fix: meta_init: false"):
        FSDPTPStrategy.quantize_base(strategy, on_meta)
    for name in [name for name in sys.modules if name.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed
    with pytest.raises(ConfigError, match=r'needs torchao.*pip install -e "\.\[qlora\]"'):
        HFCausalLM(config={"model_type": "llama", **LLAMA}, lora=QLORA)


def test_the_planner_counts_the_nf4_base_at_its_stored_size():
    """QLoRA against LoRA on [[4], ["fsdp"]], a 2 x 128 GPT with adapters on q and v: the weights differ by the NF4
    weights' fp32 bytes less their stored bytes (a shard of each, per rank), and so do the gathered bytes at once."""
    from parallelkit.mesh import MeshSpec
    from parallelkit.models import GPT
    from parallelkit.planner import Hardware, Workload, estimate, profile

    sizes, lora = {"n_layer": 2, "n_head": 4, "n_embd": 128}, {"rank": 4, "targets": ["attn.q", "attn.v"]}
    with torch.device("meta"):
        plain, quantized = GPT(**sizes, lora=lora), GPT(**sizes, lora={**lora, "quantize_base": "nf4"})
    work, hw, mesh = Workload(seq_len=32, micro_batch=2), Hardware(1, 4, 80e9), MeshSpec((4,), ("fsdp",))
    a, b = estimate(profile(plain, 32), mesh, work, hw), estimate(profile(quantized, 32), mesh, work, hw)
    weights = 2 * 2 * 128 * 128  # q and v of 2 blocks
    saved = 4 * weights - 4 * nf4_bytes(128 * 128)
    assert a.params - b.params == pytest.approx(saved / 4)
    assert a.grads == b.grads and a.optimizer == b.optimizer
    assert nf4_bytes(128 * 128) / (128 * 128) < 0.53


def test_quantize_others_stores_every_other_linear_layer_but_the_output_layer_in_4_bits():
    from parallelkit.models import GPT

    torch.manual_seed(0)
    lora = {"rank": 4, "targets": ["attn.q"], "quantize_base": "nf4", "quantize_others": True}
    gpt = GPT(n_layer=2, n_head=4, n_embd=128, lora=lora)
    layers = ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.up", "mlp.down")
    assert quantized_names(gpt) == [f"blocks.{i}.{layer}.weight" for i in range(2) for layer in layers]
    assert [name for name, p in gpt.named_parameters() if p.requires_grad] == [
        f"blocks.{i}.attn.q.{p}" for i in range(2) for p in ("lora_A", "lora_B")
    ]
    tokens = torch.randint(0, 256, (2, 16))
    gpt.pipeline_loss(gpt(tokens[:, :-1]), tokens[:, 1:]).backward()  # trains through the 4-bit layers
    assert gpt.blocks[0].attn.q.lora_B.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="quantize_others=true stores the other linear layers as quantize_base"):
        GPT(n_layer=1, n_head=4, n_embd=128, lora={"quantize_others": True})
