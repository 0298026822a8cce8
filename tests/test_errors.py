"""Bad input through the CLI, as a new user makes it: each class ends in parallelkit's one-paragraph error on stderr
(field, value, fix), printed once however many ranks met it, exit code 2, no traceback, no hang."""

import argparse
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from support import REPO, callback, common, fit, parallelkit

import parallelkit as _  # noqa: F401  registers parallelkit's and the plugins' strategies, which the error must list

QUICK = ("--trainer.max_steps=1",)  # should a refusal regress into a run, keep it short


class Payload:
    """A pickled custom class: what `torch.load(weights_only=True)` refuses."""


def pickled_class(tmp: Path) -> str:
    path = tmp / "payload.ckpt"
    torch.save({"state_dict": {}, "payload": Payload()}, path)
    return str(path)


def corrupt_metadata(tmp: Path) -> str:
    path = tmp / "epoch=0-step=10.ckpt"
    path.mkdir()
    (path / ".metadata").write_bytes(b"\x80\x04truncated")
    return str(path)


def hf_checkpoint(tmp: Path) -> str:
    """A single-file HFCausalLM checkpoint, as a run with save_distributed_checkpoint=false writes it."""
    from models import TINY_LLAMA

    from parallelkit.models import HFCausalLM

    model = HFCausalLM({"model_type": "llama", **TINY_LLAMA})
    path = tmp / "run.ckpt"
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, path)
    return str(path)


def export(*args: str, ckpt: Callable[[Path], str] = hf_checkpoint) -> Callable[[Path], subprocess.CompletedProcess]:
    return lambda tmp: parallelkit("export-hf", ckpt(tmp), str(tmp / "out"), *args, cwd=tmp, timeout=120)


def not_a_checkpoint(tmp: Path) -> str:
    path = tmp / "notes.ckpt"
    path.write_text("not a checkpoint\n")
    return str(path)


def pretrained_with(tmp: Path, config: dict | str | None = None, tokenizer: str | None = None) -> str:
    """A tiny Llama as save_pretrained writes it, then its config.json changed (`config`: fields to set, or the
    file's whole text) and a tokenizer.json of the given text added."""
    import json

    from models import TINY_LLAMA
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = tmp / "llama"
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY_LLAMA)).save_pretrained(directory)
    path = directory / "config.json"
    if isinstance(config, dict):
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    elif config is not None:
        path.write_text(config)
    if tokenizer is not None:
        (directory / "tokenizer.json").write_text(tokenizer)
    return str(directory)


def fit_pretrained(**changes: object) -> Callable[[Path], subprocess.CompletedProcess]:
    def run(tmp: Path) -> subprocess.CompletedProcess:
        directory = pretrained_with(tmp, **changes)
        overrides = (f"--model.init_args.pretrained={directory}", "--model.init_args.config=null")
        return fit("hf_llama.yaml", tmp, *QUICK, *overrides, timeout=120)

    return run


def bad_yaml(tmp: Path) -> str:
    path = tmp / "run.yaml"
    path.write_text("trainer:\n  max_steps: 1\n  devices: [1\nmodel: {class_path: parallelkit.models.GPT}\n")
    return str(path)


def plan(*args: str) -> Callable[[Path], subprocess.CompletedProcess]:
    return lambda tmp: parallelkit("plan", "--devices-per-node", "4", *args, cwd=tmp, timeout=120)


def fit_config(config: str, *overrides: str) -> Callable[[Path], subprocess.CompletedProcess]:
    return lambda tmp: fit(config, tmp, *QUICK, *overrides, timeout=120)


HYBRID = str(REPO / "configs" / "hybrid.yaml")
DAMAGED_TOKENIZER = '{"version": "1.0", "model": {"type": "BPE", "vocab": {'


def text_file(tmp: Path) -> Path:
    (tmp / "text.txt").write_text("Some text to tokenize.\n")
    return tmp / "text.txt"


PRESET_70B = str(REPO / "configs" / "models" / "llama3_70b.yaml")  # fits no 8 processes of any machine's memory


def misspelt(config: str, key: str, typo: str) -> Callable[[Path], subprocess.CompletedProcess]:
    """`fit` of configs/<config> with `key:` spelt `typo:` in the YAML."""

    def run(tmp: Path) -> subprocess.CompletedProcess:
        path = tmp / "run.yaml"
        path.write_text((REPO / "configs" / config).read_text().replace(f" {key}:", f" {typo}:", 1))
        return parallelkit("fit", "--config", str(path), cwd=tmp, timeout=120)

    return run


BEFORE_LAUNCH: dict[str, tuple[Callable[[Path], subprocess.CompletedProcess], list[str]]] = {
    "unknown strategy name": (
        fit_config("single.yaml", "--trainer.strategy=fsdp_tq"),
        ["trainer.strategy='fsdp_tq'", "Did you mean 'fsdp_tp'?", *StrategyRegistry.available_strategies()],
    ),
    "precision a parallelkit strategy does not run": (
        fit_config("hybrid.yaml", "--trainer.precision=16-mixed"),
        ["precision='16-mixed'", "use one of 32-true, bf16-mixed, bf16-true"],
    ),
    "accumulate_grad_batches below 1": (
        fit_config("single.yaml", "--trainer.accumulate_grad_batches=0"),
        ["trainer.accumulate_grad_batches=0", "must be at least 1", "Fix: 1 (a step per batch"],
    ),
    "auto mesh that fits nowhere": (
        fit_config(
            "hybrid.yaml",  # meta_init: the 39B-parameter GPT is never allocated, only planned
            "--trainer.strategy.mesh_shape=auto",
            "--model.init_args.n_layer=48",
            "--model.init_args.n_embd=8192",
            "--model.init_args.n_head=64",
        ),
        ["mesh_shape='auto': GPT fits no layout of 1 x 4 processes", "nothing was launched", "over the", "Fix: more"],
    ),
    "datamodule argument": (
        fit_config("single.yaml", "--data.init_args.batch_size=-1"),
        ["batch_size is -1", "Fix: set data.batch_size >= 1"],
    ),
    "model argument": (
        fit_config("single.yaml", "--model.init_args.n_embd=65"),
        ["n_embd=65 is not a multiple of n_head=4", "Fix: set model.init_args.n_head to a divisor of 65"],
    ),
    "Hugging Face config that transformers refuses": (
        fit_config("hf_llama.yaml", '--model.init_args.config={"model_type": "llama", "hidden_size": 63}'),
        ["model.config is not a valid llama config", "hidden size (63) is not a multiple of", "Fix the sizes"],
    ),
    "Hugging Face model type that does not exist": (
        fit_config("hf_llama.yaml", '--model.init_args.config={"model_type": "lama"}'),
        ["model.config model_type='lama' is not a model type transformers", "Did you mean 'llama'?"],
    ),
    "a key of an inline Hugging Face config misspelt": (  # transformers would keep it and route top-8
        misspelt("moe.yaml", "num_experts_per_tok", "num_experts_per_tokk"),
        [
            "model.config has a key Qwen3MoeConfig (model_type qwen3_moe) does not know: num_experts_per_tokk=2",
            "did you mean 'num_experts_per_tok', which stays 8?",
            "Fix: rename or remove it in model.init_args.config",
        ],
    ),
    "a key misspelt in the config given beside a pretrained directory": (  # its config.json's own keys are not judged
        lambda tmp: fit(
            "hf_llama.yaml",
            tmp,
            *QUICK,
            f"--model.init_args.pretrained={pretrained_with(tmp)}",
            '--model.init_args.config={"model_type": "llama", "vocab_size": 256, "rms_norm_epsilon": 1e-5}',
            timeout=120,
        ),
        [
            "model.config has a key LlamaConfig (model_type llama) does not know: rms_norm_epsilon=1e-05",
            "did you mean 'rms_norm_eps', which stays 1e-06?",
            "Fix: rename or remove it",
        ],
    ),
    "pretrained config.json with an unknown model_type": (
        fit_pretrained(config={"model_type": "lama"}),
        ["llama/config.json model_type='lama' is not a model type transformers", "Did you mean 'llama'?"],
    ),
    "pretrained config.json whose heads do not divide the hidden size": (
        fit_pretrained(config={"hidden_size": 63}),
        ["llama/config.json is not a valid llama config", "hidden size (63) is not a multiple of", "Fix the fields"],
    ),
    "pretrained config.json that is not JSON": (
        fit_pretrained(config='{"model_type": "llama",'),
        ["llama/config.json is not JSON", "damaged or cut short", "Fix: save the model's config again"],
    ),
    "pretrained config.json whose code ships in the directory": (
        fit_pretrained(config={"auto_map": {"AutoModelForCausalLM": "modeling_mine.MineForCausalLM"}}),
        ["has auto_map (AutoModelForCausalLM: modeling_mine.MineForCausalLM)", "does not run code from model", "Fix"],
    ),
    "pretrained config.json with pad_token_id outside the vocabulary": (
        fit_pretrained(config={"pad_token_id": 999}),
        ["llama/config.json has pad_token_id=999, outside its vocabulary of vocab_size=256", "a pad_token_id below"],
    ),
    "byte-level data for a pretrained model with its own tokenizer": (
        fit_pretrained(tokenizer="{}"),  # refused for being there: nothing reads it
        [
            "data is TextDataModule, which feeds bytes (ids 0-255), but the model HFCausalLM comes with its own "
            "tokenizer",
            "llama, 256 tokens",
            "Fix: --data=parallelkit.data.TokenizedDataModule",
        ],
    ),
    "byte-level data for a model whose vocabulary is not bytes": (
        fit_config("single.yaml", "--model.init_args.vocab_size=320"),
        ["the model GPT has vocab_size 320, not the 256 byte values", "--data.init_args.tokenizer=TOKENIZER_DIR"],
    ),
    "inline config with pad_token_id outside the vocabulary": (
        fit_config(
            "hf_llama.yaml", '--model.init_args.config={"model_type": "llama", "vocab_size": 256, "pad_token_id": 300}'
        ),
        ["model.config has pad_token_id=300, outside its vocabulary of vocab_size=256", "Fix the sizes"],
    ),
    "ckpt_path that does not exist": (
        lambda tmp: fit("single.yaml", tmp, *QUICK, f"--ckpt_path={tmp / 'nope.ckpt'}", timeout=120),
        ["nope.ckpt does not exist", "ckpt_path=last"],
    ),
    "ckpt_path directory without .metadata": (
        lambda tmp: fit("hybrid.yaml", tmp, *QUICK, f"--ckpt_path={tmp}", timeout=120),
        ["is not a sharded (DCP) checkpoint: it has no .metadata file", "Pass the checkpoint directory"],
    ),
    "ckpt_path with a corrupt .metadata": (
        lambda tmp: fit("hybrid.yaml", tmp, *QUICK, f"--ckpt_path={corrupt_metadata(tmp)}", timeout=120),
        ["step=10.ckpt/.metadata cannot be read", "damaged or incomplete", "Fix: use another checkpoint"],
    ),
    "checkpoint that weights_only refuses": (
        lambda tmp: fit("single.yaml", tmp, *QUICK, f"--ckpt_path={pickled_class(tmp)}", timeout=120),
        ["payload.ckpt holds pickled Python objects (test_errors.Payload)", "refuses for safety", "nothing was loaded"],
    ),
    "export-hf of a file that is not a checkpoint": (
        export(ckpt=not_a_checkpoint),
        ["checkpoint", "notes.ckpt is not a readable checkpoint", "Fix: a file torch.save"],
    ),
    "export-hf with a negative --max-shard-size": (
        export("--max-shard-size=-1GB"),
        ["--max-shard-size '-1GB' is not a size", "Fix: a positive number of bytes"],
    ),
    "export-hf with a --tokenizer directory that does not exist": (
        export("--tokenizer", "no-such-dir"),
        ["--tokenizer no-such-dir is not a directory", "tokenizer.json", "Fix: the directory the tokenizer was saved"],
    ),
    "plan with an unparsable --device-memory": (
        plan("--config", HYBRID, "--device-memory", "80XB"),
        ["--device-memory '80XB' is not a size", "e.g. 80GB or 24GiB"],
    ),
    "plan with a config file that does not exist": (
        plan("--config", "missing.yaml", "--device-memory", "80GB"),
        ["--config missing.yaml cannot be read: No such file or directory", "Fix: the path of a YAML file"],
    ),
    "fit with a config file that does not exist": (
        lambda tmp: parallelkit("fit", "--config", "configs/hybird.yaml", cwd=tmp, timeout=120),
        ["--config configs/hybird.yaml cannot be read: No such file or directory", "Fix: the path of a YAML file"],
    ),
    "a strategy option misspelt in the config": (
        misspelt("hybrid.yaml", "mesh_shape", "mesh_shpe"),
        [
            "trainer.strategy.init_args.mesh_shpe is not an option of parallelkit.FSDPTPStrategy (it takes mesh_shape,",
            "Did you mean 'mesh_shape'?",
            "Fix: rename the key",
        ],
    ),
    "a trainer option misspelt in the config": (
        misspelt("hybrid.yaml", "max_steps", "max_step"),
        ["trainer.max_step is not an option parallelkit's fit knows. Did you mean 'trainer.max_steps'?"],
    ),
    "a trainer option misspelt on validate's command line": (  # argparse's lower-case "unrecognized arguments"
        lambda tmp: parallelkit("validate", "--config", HYBRID, "--trainer.max_stepz=4", cwd=tmp, timeout=120),
        ["trainer.max_stepz is not an option parallelkit's validate knows. Did you mean 'trainer.max_steps'?"],
    ),
    "a model option misspelt on the command line": (
        fit_config("single.yaml", "--model.init_args.n_heads=4"),
        ["model.init_args.n_heads is not an option of parallelkit.models.GPT", "Did you mean 'n_head'?"],
    ),
    "options of a strategy given by its registered name": (  # the name took its class's options: the mesh is checked
        fit_config("single.yaml", "--trainer.strategy=fsdp_tp", "--trainer.strategy.mesh_shape=[[1, 3], [fsdp, tp]]"),
        ["fsdp=1 x tp=3 = 3 processes", "world size is 1"],
    ),
    "a sequence cp cannot cut into 2 x cp chunks": (
        fit_config(
            "hybrid.yaml", '--trainer.strategy.mesh_shape=[[1, 4], ["fsdp", "cp"]]', "--data.init_args.seq_len=60"
        ),
        ["data.seq_len=60 is not divisible by 2 x cp = 8", "Fix: data.seq_len=56"],
    ),
    "a Hugging Face family whose attention cp cannot split": (  # Bloom's attention is its own code
        fit_config(
            "hf_llama.yaml",
            '--model.init_args.config={"model_type": "bloom", "vocab_size": 256, "hidden_size": 64, "n_layer": 2}',
            '--trainer.strategy.mesh_shape=[[2, 2], ["fsdp", "cp"]]',
        ),
        [
            "HFCausalLM (bloom): with its sequences split over cp ranks",
            "its attention cannot be split (docs/families.md, column cp, says why). Fix: a mesh",
        ],
    ),
    "compile and activation checkpointing together under cp": (
        fit_config(
            "hybrid.yaml",
            '--trainer.strategy.mesh_shape=[[2, 2], ["fsdp", "cp"]]',
            "--trainer.strategy.compile=aot_eager",
            "--trainer.strategy.activation_checkpointing=full",
        ),
        ["on a mesh with cp=2: a compiled block runs its cp attention eagerly", "Fix: one of compile or activation"],
    ),
    "a dry run of a model preset, which names no strategy": (
        lambda tmp: parallelkit("check", "--dry-run", "--config", PRESET_70B, "--devices-per-node", "8", cwd=tmp),
        [
            "this config's strategy is DDPStrategy, which shards nothing (a model preset names no strategy)",
            "Fix: name one, e.g. --trainer.strategy=fsdp_tp --trainer.strategy.mesh_shape=auto --device-memory 80GB",
        ],
    ),
    "a dry run's auto mesh planned against this machine's memory": (
        lambda tmp: parallelkit(
            "check",
            "--dry-run",
            "--config",
            PRESET_70B,
            "--devices-per-node",
            "8",
            "--trainer.strategy=fsdp_tp",
            "--trainer.strategy.mesh_shape=auto",
            cwd=tmp,
        ),
        [
            "fits no layout of 1 x 8 processes",
            "(this machine's memory over 8 processes)",
            "Or give the mesh yourself:",
            "For a cluster's devices: parallelkit check --dry-run --device-memory 80GB",
        ],
    ),
    "a validation split smaller than one global batch": (  # 4 processes would start, then each refuse it
        fit_config("sft.yaml", "--data.init_args.val_fraction=0.002"),
        [
            "4000 examples (the built-in conversations)",
            "(1) the validation split holds 4 rows, fewer than one global batch of 8",
            "Fix, all at once: --data.init_args.val_fraction=0.05 (then 3800 train examples",
        ],
    ),
    "val_check_interval beyond an epoch's batches": (
        # A text of fixed size (~100 KB: about 190 batches of 8 x 64 bytes an epoch, a val split of 10 batches).
        fit_config("single.yaml", f"--data.init_args.paths={argparse.__file__}", "--trainer.val_check_interval=500"),
        [
            "trainer.val_check_interval=500 batches is more than an epoch's",
            "validation would never run",
            "Fix: --trainer.val_check_interval=",
        ],
    ),
    "checkpointing off with a ModelCheckpoint in the config": (
        fit_config("sft.yaml", "--trainer.enable_checkpointing=false"),
        ["trainer.enable_checkpointing=false, but trainer.callbacks holds a ModelCheckpoint", "--trainer.callbacks=[]"],
    ),
    "a damaged tokenizer.json, met as the data is tokenized before launch": (
        lambda tmp: fit(
            "finetune.yaml",
            tmp,
            *QUICK,
            f"--model.init_args.pretrained={pretrained_with(tmp, tokenizer=DAMAGED_TOKENIZER)}",
            f"--data.init_args.paths={text_file(tmp)}",
            timeout=120,
        ),
        ["llama/tokenizer.json is not a tokenizer the tokenizers library can read"],
    ),
    "YAML syntax error": (
        lambda tmp: parallelkit("fit", "--config", bad_yaml(tmp), cwd=tmp, timeout=120),
        ["run.yaml is not valid YAML at line 4, column 6", "expected ',' or ']'", "Fix the YAML there"],
    ),
    # Mesh errors, through `fit` (test_cli.py checks them through `parallelkit env`).
    "sequence parallelism asked of a plan with no sequence to shard": (
        fit_config("hybrid.yaml", "--model=models.TokenBagClassifier", "--trainer.strategy.sequence_parallel=true"),
        ["sequence_parallel=True, but TokenBagClassifier's tp_plan shards nothing on the sequence dim", "Fix:"],
    ),
    "mesh product is not the world size": (
        fit_config("hybrid.yaml", "--trainer.strategy.mesh_shape=[[2, 3], [fsdp, tp]]"),
        ["fsdp=2 x tp=3 = 6 processes", "world size is 4", 'Fix: use mesh_shape [[2, 2], ["fsdp", "tp"]]'],
    ),
    "unknown axis name": (
        fit_config("hybrid.yaml", "--trainer.strategy.mesh_shape=[[2, 2], [fsdp, mp]]"),
        ["unknown axis 'mp'", "Axis names are pp, replicate, fsdp, ep, cp, tp"],
    ),
    "repeated axis name": (
        fit_config("hybrid.yaml", "--trainer.strategy.mesh_shape=[[2, 2], [fsdp, fsdp]]"),
        ["repeats the axis 'fsdp'", "give 'fsdp' one larger size"],
    ),
    "axis size below 1": (
        fit_config("hybrid.yaml", "--trainer.strategy.mesh_shape=[[0, 4], [fsdp, tp]]"),
        ["gives axis 'fsdp' size 0", "sizes are >= 1, or -1"],
    ),
}

AFTER_LAUNCH: dict[str, tuple[list[str], list[str]]] = {
    "tp not dividing the heads": (
        [
            "hybrid.yaml",
            "--trainer.devices=2",
            "--trainer.strategy.mesh_shape=[[1, 2], [fsdp, tp]]",
            "--model.init_args.n_head=1",
        ],
        ["GPT has 1 attention heads (blocks.0.attn), which tp=2 does not divide", "Fix: a tp that divides"],
    ),
    "tp not dividing a hidden size": (
        [
            "hybrid.yaml",
            "--trainer.devices=2",
            "--trainer.strategy.mesh_shape=[[1, 2], [fsdp, tp]]",
            "--model.init_args.n_head=3",
            "--model.init_args.n_embd=63",
        ],
        ["GPT.blocks.0.attn.q (colwise) has out_features=63, which tp=2 does not divide", "Fix: choose a tp"],
    ),
    "more pipeline stages than layers": (
        ["interleaved.yaml", "--model.init_args.n_layer=1", "--trainer.strategy.stages_per_rank=3"],
        ["6 pipeline stages need at least 6 pipeline layers, but GPT has 4", "Fix: fewer stages"],
    ),
    "microbatches not dividing the batch": (
        ["1f1b.yaml", "--trainer.strategy.microbatches=3"],
        ["microbatches=3 does not divide the per-process batch of 8 (data.batch_size)", "Fix: a batch size"],
    ),
}


def assert_one_paragraph_error(proc: subprocess.CompletedProcess, fragments: list[str]) -> None:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]
    assert output.count("parallelkit: error:") == 1, output[-4000:]  # once, not once per rank
    error = proc.stderr.rstrip().splitlines()[-1]  # one paragraph, and the last thing said
    assert error.startswith("parallelkit: error: "), proc.stderr[-4000:]
    for fragment in fragments:
        assert fragment in error, f"{fragment!r} not in {error!r}"


@pytest.mark.parametrize("case", BEFORE_LAUNCH)
def test_bad_input_before_launch_is_one_paragraph_error(tmp_path: Path, case: str):
    run, fragments = BEFORE_LAUNCH[case]
    proc = run(tmp_path)
    assert_one_paragraph_error(proc, fragments)
    assert "Initializing distributed" not in proc.stdout + proc.stderr  # Lightning's line as each rank starts


@pytest.mark.parametrize("case", AFTER_LAUNCH)
def test_bad_input_every_rank_meets_is_reported_once(tmp_path: Path, corpus: Path, case: str):
    (config, *overrides), fragments = AFTER_LAUNCH[case]
    proc = fit(config, tmp_path, *common(corpus, tmp_path / "cache", steps=1), *overrides, timeout=180)
    assert_one_paragraph_error(proc, fragments)


def test_an_error_only_rank_zero_meets_is_reported_once_and_the_other_ranks_stay_silent(tmp_path: Path):
    """An error rank 0 alone meets after launch (`models.FailOnRankZero`, as a user's datamodule's `prepare_data`
    would: Lightning runs it on rank 0 only): its error is the job's one paragraph, and the ranks waiting for it end
    without a traceback of their own (a collective whose peer is gone)."""
    proc = fit(
        "hybrid.yaml",
        tmp_path,
        *QUICK,
        "--trainer.devices=2",
        "--trainer.strategy.mesh_shape=[[2, 1], [fsdp, tp]]",
        callback("models.FailOnRankZero"),
        timeout=180,
    )
    assert_one_paragraph_error(proc, ["rank 0 alone met this (models.FailOnRankZero)"])


def test_sft_on_a_dozen_chats_names_every_problem_at_once_with_overrides_that_pass(tmp_path: Path):
    """configs/sft.yaml on 12 chats stopped three times in a row (a train split under one global batch, then the
    validation split, then val_check_interval past an epoch): one refusal names the three, with one set of overrides
    that the same check accepts (run here in this process: the refusal's check, on the data it tokenized)."""
    import json
    import re
    from types import SimpleNamespace

    import yaml

    from parallelkit.data import SFTDataModule

    chats = tmp_path / "chats.jsonl"
    turns = [("system", "You are helpful."), ("user", "What is {i} + {i}?"), ("assistant", "{i} + {i} = {twice}.")]
    chats.write_text(
        "".join(
            json.dumps({"messages": [{"role": r, "content": c.format(i=i, twice=2 * i)} for r, c in turns]}) + "\n"
            for i in range(12)
        )
    )
    data = (f"--data.init_args.paths={chats}", f"--data.init_args.cache_dir={tmp_path / 'cache'}")
    proc = fit("sft.yaml", tmp_path, *QUICK, *data, timeout=120)
    assert "SFT data: 12 examples: 11 train, 1 validation (" in proc.stdout + proc.stderr  # not "the train split"
    fix = "--data.init_args.batch_size=1 --data.init_args.val_fraction=0.3 --trainer.val_check_interval=1"
    assert_one_paragraph_error(
        proc,
        [
            "The SFT data is too small for this run: 12 examples",
            "where a global batch is 8 rows (data.batch_size 4 x data-parallel size 2). 3 problems:",
            "(1) the train split holds 4 rows, fewer than one global batch of 8",
            "(2) the validation split holds 1 row, fewer than one global batch of 8",
            "(3) trainer.val_check_interval=50 batches is more than an epoch's 0 training batches",
            f"Fix, all at once: {fix} (then 8 train examples in 3 rows, 4 validation in 2 rows",
        ],
    )
    overrides = dict(re.findall(r"--([\w.]+)=(\S+)", proc.stderr.rsplit("Fix, all at once:", 1)[1].split(" (")[0]))
    config = yaml.safe_load((REPO / "configs" / "sft.yaml").read_text())
    trainer = SimpleNamespace(
        **{key: config["trainer"].get(key) for key in ("val_check_interval", "limit_val_batches")},
        limit_train_batches=1.0,
        check_val_every_n_epoch=1,
    )
    options = {**config["data"]["init_args"], "paths": str(chats), "cache_dir": str(tmp_path / "cache")}
    for key, value in overrides.items():
        if key.startswith("trainer."):
            setattr(trainer, key.removeprefix("trainer."), yaml.safe_load(value))
        else:
            options[key.removeprefix("data.init_args.")] = yaml.safe_load(value)
    SFTDataModule(**options).check_launch(None, 2, trainer)  # fsdp 2 x tp 2: 2 data-parallel processes
