"""Hugging Face checkpoints in and out: a `save_pretrained` directory fine-tuned under any layout, each process
reading only what it holds, and the result exported back to a directory transformers loads."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from models import TINY_LLAMA
from safetensors import safe_open
from snippets import parallelkit_args, snippet
from support import REPO, assert_ok, assert_same_losses, common, fit, fit_command, parallelkit, step_losses
from transformers import AutoConfig, AutoModelForCausalLM

from parallelkit.checkpoint import consolidate
from parallelkit.data import TextDataModule
from parallelkit.errors import ConfigError
from parallelkit.models import HFCausalLM
from parallelkit.models.hf_export import export_hf
from parallelkit.models.hf_io import INDEX

LLAMA = TINY_LLAMA
STEPS = 10


@pytest.fixture(scope="module")
def pretrained(pretrained_llama) -> Path:
    """A small Llama as `save_pretrained` writes it, in two safetensors shards with an index."""
    directory = pretrained_llama("sharded", tokenizer=False, max_shard_size="300KB")
    assert len(json.loads((directory / INDEX).read_text())["weight_map"]) == 21
    assert len(list(directory.glob("model-*-of-00002.safetensors"))) == 2
    return directory


def finetune(pretrained: Path, *layout: str) -> tuple[str, ...]:
    return (f"--model.init_args.pretrained={pretrained}", "--model.init_args.config=null", *layout)


LAYOUTS = {
    "one_process": (
        "--trainer.devices=1",
        '--trainer.strategy.mesh_shape=[[1], ["fsdp"]]',
        "--data.init_args.batch_size=8",
    ),
    "hybrid_2x2": (),  # configs/hf_llama.yaml's own layout; it also checkpoints at the last step
    "fsdp_4x1": ('--trainer.strategy.mesh_shape=[[4, 1], ["fsdp", "tp"]]', "--data.init_args.batch_size=2"),
    "1f1b_pp2": (
        "--trainer.strategy=parallelkit.PipelineStrategy",
        '--trainer.strategy.mesh_shape=[[2], ["pp"]]',
        "--trainer.strategy.meta_init=true",
        "--trainer.devices=2",
        "--data.init_args.batch_size=8",
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, pretrained) -> Path:
    """`STEPS` steps of fine-tuning from the pretrained directory under each layout (meta_init: every process reads only
    the tensors' parts it holds); the 2 x 2 run checkpoints at its last step."""
    root = tmp_path_factory.mktemp("finetune")
    for name, layout in LAYOUTS.items():
        save = [f"--trainer.callbacks+={json.dumps(checkpoint(root / 'ckpt'))}"] if name == "hybrid_2x2" else []
        overrides = (*common(corpus, root / "cache", steps=STEPS), *finetune(pretrained, *layout), *save)
        assert_ok(fit("hf_llama.yaml", root / name, *overrides))
    return root


def checkpoint(dirpath: Path) -> dict:
    args = {"dirpath": str(dirpath), "every_n_train_steps": STEPS, "save_top_k": -1, "save_last": False}
    return {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": args}


def first_batch_loss(pretrained: Path, corpus: Path, cache: Path) -> float:
    """transformers' own `from_pretrained` model, in this process, on the global batch every run trains on first."""
    data = TextDataModule(paths=str(corpus), seq_len=64, batch_size=8, cache_dir=str(cache))
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    model = AutoModelForCausalLM.from_pretrained(pretrained)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item()


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "one_process"])
def test_pretrained_weights_load_under_any_layout_and_train_as_one_process(runs, corpus, pretrained, name):
    losses, single = step_losses(runs / name), step_losses(runs / "one_process")
    assert sorted(losses) == list(range(STEPS))
    assert_same_losses(single, losses)


def test_every_layout_starts_from_the_pretrained_models_own_loss(runs, corpus, pretrained):
    expected = first_batch_loss(pretrained, corpus, runs / "cache")
    for name in LAYOUTS:
        assert_same_losses({0: expected}, {0: step_losses(runs / name)[0]})


def test_export_writes_what_from_pretrained_loads_bit_equal_to_the_trained_weights(tmp_path, runs, pretrained):
    trained = runs / "ckpt" / f"epoch=0-step={STEPS}.ckpt"
    out = tmp_path / "exported"
    proc = parallelkit("export-hf", str(trained), str(out), "--max-shard-size", "100KB", cwd=tmp_path)
    assert_ok(proc)
    assert "warn" not in proc.stderr.lower(), proc.stderr
    (tmp_path / "made").mkdir()  # the mode save_pretrained's folder gets (0755 under the usual umask), not 0700
    assert out.stat().st_mode & 0o777 == (tmp_path / "made").stat().st_mode & 0o777
    weights = torch.load(consolidate(trained, tmp_path / "weights.pt"), weights_only=True)
    assert len(json.loads((out / INDEX).read_text())["weight_map"]) == 21 and len(list(out.glob("*.safetensors"))) > 2
    exported = AutoModelForCausalLM.from_pretrained(out)
    state = exported.state_dict()
    assert sorted(f"model.{k}" for k in state) == sorted(weights)
    for key, value in state.items():
        assert torch.equal(value, weights[f"model.{key}"]), key
    before = AutoModelForCausalLM.from_pretrained(pretrained).state_dict()
    assert not any(torch.equal(value, before[key]) for key, value in state.items())  # the steps moved every tensor
    model = HFCausalLM(pretrained=str(pretrained))
    model.load_state_dict(weights)
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=tokens).logits, model(tokens))


def test_export_of_a_tied_model_writes_the_shared_weight_once(tmp_path):
    tied = {"model_type": "qwen3", **LLAMA, "head_dim": 16, "tie_word_embeddings": True}
    model = HFCausalLM(tied)
    ckpt = tmp_path / "tied.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, ckpt)
    out = export_hf(ckpt, tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.model.lm_head.weight)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = set(f.keys())  # a safetensors file handle has no `in`
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_a_directory_that_is_not_a_checkpoint_or_lacks_a_shard_or_does_not_fit_the_config_is_named(
    tmp_path, pretrained
):
    with pytest.raises(ConfigError, match=r"is not a Hugging Face model directory: it has no config.json"):
        HFCausalLM(pretrained=str(tmp_path))
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in pretrained.iterdir():
        if path.name != "model-00002-of-00002.safetensors":
            (broken / path.name).write_bytes(path.read_bytes())
    with pytest.raises(ConfigError, match=r"lists model-00002-of-00002.safetensors \(holding [\w.]+, among others\)"):
        HFCausalLM(pretrained=str(broken))
    wider = {"model_type": "llama", **LLAMA, "intermediate_size": 96}
    with pytest.raises(ConfigError, match=r"holds model.layers.0.mlp.(gate|up)_proj.weight of shape \[128, 64\], but "):
        HFCausalLM(config=wider, pretrained=str(pretrained))


def test_a_config_json_keeps_keys_of_its_own_where_an_inline_config_is_refused_them(tmp_path, pretrained):
    """A saved config.json may carry keys its class does not declare (a note, a tool's field): they load as
    transformers loads them. The same key in an inline config (given beside `pretrained`, it replaces config.json)
    is refused, as a misspelt field would silently leave the model at that field's default."""
    noted = tmp_path / "noted"
    noted.mkdir()
    for path in pretrained.iterdir():
        (noted / path.name).symlink_to(path)
    (noted / "config.json").unlink()
    (noted / "config.json").write_text(json.dumps({**json.loads((pretrained / "config.json").read_text()), "notes": 1}))
    assert HFCausalLM(pretrained=str(noted)).config.notes == 1
    with pytest.raises(ConfigError, match=r"LlamaConfig \(model_type llama\) does not know: notes=1\. .* Its fields: "):
        HFCausalLM(config={"model_type": "llama", **LLAMA, "notes": 1}, pretrained=str(pretrained))


def test_plan_recommends_a_fitting_layout_for_the_llama_70b_preset_with_its_published_parameter_count(tmp_path):
    config = REPO / "configs" / "models" / "llama3_70b.yaml"
    args = ["plan", "--config", str(config), "--nodes", "4", "--devices-per-node", "8", "--device-memory", "80GB"]
    proc = parallelkit(*args, "--json", cwd=tmp_path)
    assert_ok(proc)
    report = json.loads(proc.stdout)
    assert report["recommended"]["fits"] and report["recommended"]["peak"] <= 80e9
    table = parallelkit(*args, cwd=tmp_path)
    assert_ok(table)
    assert "70.55B parameters" in table.stdout  # Llama-3.1-70B: 70,553,706,496
    with torch.device("meta"):
        model = HFCausalLM(**yaml.safe_load(config.read_text())["model"]["init_args"])
    assert model.model.num_parameters() == 70_553_706_496


def tokenizer_and_model(directory: Path, corpus: Path) -> None:
    """A byte-level BPE tokenizer trained here on local text, and a small Llama of its vocabulary, saved together as
    a Hugging Face model directory is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"], show_progress=False)
    bpe.train_from_iterator([corpus.read_text()[:200_000]], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    tokenizer.save_pretrained(directory)
    config = AutoConfig.for_model("llama", **{**LLAMA, "vocab_size": len(tokenizer)})
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def test_the_guides_fine_tune_runs_end_to_end_and_transformers_loads_the_result(tmp_path, corpus):
    """The Hugging Face guide's fine-tuning: configs/finetune.yaml with only the pretrained directory and the text
    given (the model's own tokenizer tokenizes the text, the weights load sharded), export-hf, and the guide's Python
    loading the result whole, tokenizer included."""
    base, out, run = tmp_path / "base", tmp_path / "tuned", tmp_path / "run"
    tokenizer_and_model(base, corpus)
    place = {"/data/Llama-3.2-1B-tuned": str(out), "/data/Llama-3.2-1B": str(base), "/data/my_text": str(corpus)}
    overrides = [
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
        "--data.init_args.seq_len=64",
        "--trainer.devices=2",
        "--trainer.max_steps=4",
        "--trainer.limit_val_batches=0",
        "--trainer.callbacks.init_args.every_n_train_steps=2",
    ]
    assert_ok(fit_command(parallelkit_args("hf-finetune", 0, **place), run, *overrides))
    assert sorted(step_losses(run)) == [0, 1, 2, 3]  # 4 steps at the config's fine-tuning rate: weights move a little
    assert_ok(parallelkit(*parallelkit_args("hf-finetune", 1, **place), cwd=run))
    from transformers import AutoTokenizer

    loaded: dict = {}
    exec(snippet("hf-load").text.replace("/data/Llama-3.2-1B-tuned", str(out)), loaded)
    tokenizer, original = loaded["tokenizer"], AutoTokenizer.from_pretrained(base)
    assert tokenizer("def main():")["input_ids"] == original("def main():")["input_ids"]
    tuned, before = loaded["model"], AutoModelForCausalLM.from_pretrained(base)
    assert not torch.equal(tuned.model.layers[0].mlp.up_proj.weight, before.model.layers[0].mlp.up_proj.weight)
