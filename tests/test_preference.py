"""Preference tuning (`HFCausalLM(preference=...)` on `PreferenceDataModule` pairs): one process equals TRL's
`DPOTrainer` per step (loss and every logged reward metric; full fine-tuning, LoRA with the adapters off as the
reference, IPO, the NLL term with accumulation), SimPO equals its published formula, every layout equals one process
(fsdp x tp with sequence and loss parallelism and a frozen reference sharded as the model, LoRA on fsdp x tp, cp by
all-gather and by Ulysses, accumulation, a resume in another layout), and bad pairs are refused before launch, every
one named in one message."""

import csv
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from models import TINY_LLAMA
from snippets import parallelkit_args
from support import assert_ok, checkpoint_every, fit, fit_command, made_once, parallelkit, script

from parallelkit.data import PreferenceDataModule
from parallelkit.data.chat import builtin_pairs, builtin_tokenizer, load_tokenizer
from parallelkit.errors import DataError
from parallelkit.models.preference import METRICS

DPO = "dpo.yaml"
STEPS = 6
LORA = "--model.init_args.lora={rank: 16, alpha: 32, targets: [q_proj, k_proj, v_proj, o_proj]}"  # the guide's
TRL_VARIANTS = {
    "dpo": {},
    "lora": {"lora": True},
    "ipo": {"loss_type": "ipo"},
    "robust": {"loss_type": "robust", "label_smoothing": 0.2},
    "rpo_accumulated": {"batch_size": 2, "accumulate": 2, "rpo_alpha": 0.5},
    "precomputed": {"precompute": True},
}
LOGGED = ("train_loss", *METRICS[1:], "grad_norm")
"""What a step logs: TRL's metric names, the loss as `train_loss`, and the gradient's norm (as TRL logs it): an error
of scale in the gradients, which AdamW's update would hide, shows there."""


@pytest.fixture(scope="module")
def sft_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small pretrained chat model as an SFT run exports it: a Llama with the built-in chat tokenizer beside it, and
    400 preference pairs as JSONL (`pairs.jsonl` in the same directory's parent)."""

    def make(directory: Path) -> None:
        model = directory / "model"
        torch.manual_seed(7)
        config = transformers.LlamaConfig(**{**TINY_LLAMA, "vocab_size": 264, "max_position_embeddings": 256})
        transformers.LlamaForCausalLM(config).save_pretrained(str(model))
        load_tokenizer(builtin_tokenizer(directory / "tokenizer")).save_pretrained(str(model))
        records = [record for _, record in builtin_pairs(count=400, seed=1)]
        (directory / "pairs.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))

    return made_once(tmp_path_factory, "preference-export", make) / "model"


@pytest.fixture(scope="module")
def trl(tmp_path_factory: pytest.TempPathFactory, sft_export: Path) -> dict[str, list[dict[str, float]]]:
    """TRL's `DPOTrainer` on the same model, pairs, order, optimizer and schedule (tests/scripts/trl_dpo.py): its
    per-step metrics by variant, made once in one process."""

    def make(directory: Path) -> None:
        pairs = sft_export.parent / "pairs.jsonl"
        args = [str(sft_export), str(pairs), str(directory / "trl.json"), f"--steps={STEPS}"]
        assert_ok(script("trl_dpo.py", *args, "--variants", json.dumps(TRL_VARIANTS), cwd=directory))

    return json.loads((made_once(tmp_path_factory, "preference-trl", make) / "trl.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, sft_export: Path):
    """`runs(name, *overrides)`: a 6-step run of configs/dpo.yaml from the SFT export on its pairs, made once."""

    def get(name: str, *overrides: str) -> Path:
        def make(directory: Path) -> None:
            common = (
                "--model.init_args.config=null",
                f"--model.init_args.pretrained={sft_export}",
                f"--data.init_args.paths={sft_export.parent / 'pairs.jsonl'}",
                f"--trainer.max_steps={STEPS}",
                "--model.init_args.warmup_steps=2",
                "--trainer.limit_val_batches=0",
                "--trainer.callbacks=[]",
            )
            assert_ok(fit(DPO, directory, *common, *overrides))

        return made_once(tmp_path_factory, f"preference-{name}", make)

    return get


def logged(save_dir: Path) -> list[dict[str, float]]:
    """Each step's logged values (`LOGGED`), in step order."""
    files = sorted(save_dir.rglob("metrics.csv"))
    with open(files[-1]) as f:
        rows = [row for row in csv.DictReader(f) if row.get("train_loss")]
    return [{key: float(row[key]) for key in LOGGED} for row in sorted(rows, key=lambda row: int(row["step"]))]


def assert_same_steps(expected: list[dict[str, float]], actual: list[dict[str, float]], tol: float = 1e-5) -> None:
    """Every value of every step within `tol`, relative to the value or, below 1, absolute: the rewards are
    differences of log-probs of size 50-90 (`beta` x their fp32 rounding is 4e-7)."""
    assert len(expected) == len(actual) == STEPS, (len(expected), len(actual))
    for step, (want, got) in enumerate(zip(expected, actual)):
        for key in LOGGED:
            assert abs(got[key] - want[key]) <= tol * max(abs(want[key]), 1.0), (step, key, want[key], got[key])


def as_trl(steps: list[dict[str, float]]) -> list[dict[str, float]]:
    return [
        {"train_loss": step["loss"], "grad_norm": step["grad_norm"], **{k: step[k] for k in METRICS[1:]}}
        for step in steps
    ]


ONE = ("--trainer.strategy=auto", "--trainer.devices=1")
VALIDATE = ("--trainer.limit_val_batches=2", "--trainer.val_check_interval=3")  # 2 global batches of 4 pairs
ONE_PROCESS = {
    "dpo": (*ONE, "--data.init_args.batch_size=4", *VALIDATE),
    "lora": (*ONE, "--data.init_args.batch_size=4", LORA),
    "ipo": (*ONE, "--data.init_args.batch_size=4", "--model.init_args.preference.loss_type=ipo"),
    "robust": (
        *ONE,
        "--data.init_args.batch_size=4",
        "--model.init_args.preference={loss_type: robust, label_smoothing: 0.2}",
    ),
    "rpo_accumulated": (
        *ONE,
        "--data.init_args.batch_size=2",
        "--trainer.accumulate_grad_batches=2",
        "--model.init_args.preference.rpo_alpha=0.5",
    ),
    "precomputed": (*ONE, "--data.init_args.batch_size=4", "--model.init_args.preference.reference=precomputed"),
}


@pytest.mark.parametrize("variant", list(TRL_VARIANTS))
def test_one_process_equals_trl_dpo_trainer_per_step(runs, trl, variant):
    """Full fine-tuning against a frozen copy, LoRA against the adapters switched off (TRL's PEFT path), IPO, robust DPO
    (label smoothing), the NLL term with gradient accumulation, and reference log-probs precomputed before training
    (TRL's `precompute_ref_log_probs`): TRL's loss and every metric it logs, each step."""
    assert_same_steps(as_trl(trl[variant]), logged(runs(f"one_{variant}", *ONE_PROCESS[variant])))


FSDP_TP = ("--data.init_args.batch_size=2",)  # the config's [[2, 2], ["fsdp", "tp"]]: 2 pairs x fsdp 2 = 4
PIPELINE = (
    "--trainer.strategy=parallelkit.PipelineStrategy",
    '--trainer.strategy.mesh_shape=[[2, 2], ["pp", "fsdp"]]',
    "--trainer.strategy.schedule=1f1b",
    "--trainer.strategy.microbatches=2",
)
CHECKPOINT = checkpoint_every(Path("ckpt"), 3)
LAYOUTS = {
    # the frozen reference sharded as the model: FSDP2 x tp with sequence and loss parallelism, meta_init
    "fsdp2_tp2": ("dpo", (*FSDP_TP, *VALIDATE, CHECKPOINT)),  # also validates, and checkpoints at step 3
    "fsdp2_cp2_ulysses": (
        "dpo",
        ('--trainer.strategy.mesh_shape=[[2, 2], ["fsdp", "cp"]]', "--trainer.strategy.cp_method=ulysses", *FSDP_TP),
    ),
    # each of the 2 microbatches holds whole pairs; the reference pass (adapters off) runs the schedule forward first
    "lora_1f1b_pp2_fsdp2": ("lora", (*PIPELINE, *FSDP_TP, LORA)),
    # full fine-tuning: the frozen copy split into stages as the model, two per rank, its own schedule forward only
    "interleaved_pp2_fsdp2": (
        "dpo",
        (
            "--trainer.strategy=parallelkit.PipelineStrategy",
            '--trainer.strategy.mesh_shape=[[2, 2], ["pp", "fsdp"]]',
            "--trainer.strategy.schedule=interleaved_1f1b",
            "--trainer.strategy.microbatches=2",
            *FSDP_TP,
        ),
    ),
    # pp x cp: rows padded to max_length before cp's split, each row's log-prob summed over cp on the last stage; the
    # frozen copy's stages attend across cp as the model's
    "1f1b_pp2_cp2": (
        "dpo",
        (
            *PIPELINE[:1],
            '--trainer.strategy.mesh_shape=[[2, 2], ["pp", "cp"]]',
            *PIPELINE[2:],
            "--data.init_args.batch_size=4",
        ),
    ),
    "lightning_ddp2": ("dpo", ("--trainer.strategy=ddp", "--trainer.devices=2", *FSDP_TP)),  # a whole copy per rank
    # cp by all-gather (Ulysses above), the reference precomputed before the first step: each rank its pairs'
    # share, cp's slices summed; checkpointed at step 3
    "precomputed_fsdp2_cp2": (
        "precomputed",
        (
            '--trainer.strategy.mesh_shape=[[2, 2], ["fsdp", "cp"]]',
            *FSDP_TP,
            ONE_PROCESS["precomputed"][-1],
            CHECKPOINT,
        ),
    ),
    "precomputed_1f1b_pp2_fsdp2": ("precomputed", (*PIPELINE, *FSDP_TP, ONE_PROCESS["precomputed"][-1])),
    "fsdp2_accumulate2_rpo": (
        "rpo_accumulated",
        (
            '--trainer.strategy.mesh_shape=[[2, 1], ["fsdp", "tp"]]',
            "--trainer.devices=2",
            "--data.init_args.batch_size=1",
            "--trainer.accumulate_grad_batches=2",
            "--model.init_args.preference.rpo_alpha=0.5",
        ),
    ),
}


SEEDED = {
    "vocab_size": 264,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
QLORA = (  # NF4 base weights drawn from the seed (blocks of 64 values, grouped by 256 blocks: hidden 128)
    "--model.init_args.pretrained=null",
    "--model.init_args.config="
    + json.dumps({"model_type": "llama", **SEEDED, "hidden_size": 128, "intermediate_size": 256}),
    "--model.init_args.lora={rank: 8, alpha: 16, targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
    "down_proj], quantize_base: nf4}",
    "--trainer.strategy.meta_init=false",
)
MOE = (  # a Qwen3-MoE drawn from the seed; the frozen reference's experts dispatched over ep as the model's
    "--model.init_args.pretrained=null",
    "--model.init_args.config="
    + json.dumps(
        {
            "model_type": "qwen3_moe",
            **SEEDED,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
        }
    ),
)
SEEDED_LAYOUTS = {
    "qlora_fsdp4": (QLORA, '--trainer.strategy.mesh_shape=[[4, 1], ["fsdp", "tp"]]'),
    "moe_fsdp2_ep2": (MOE, '--trainer.strategy.mesh_shape=[[2, 2], ["fsdp", "ep"]]'),
}


@pytest.mark.parametrize("layout", list(SEEDED_LAYOUTS))
def test_qlora_and_expert_parallel_equal_one_process_per_step(runs, layout):
    """QLoRA (NF4 base, the reference its adapters off) on fsdp 4, and a mixture of experts on fsdp x ep with a
    frozen reference, each against one process of the same model drawn from the seed."""
    model, mesh = SEEDED_LAYOUTS[layout]
    one = logged(runs(f"one_{layout}", *model, *ONE, "--data.init_args.batch_size=4"))
    assert_same_steps(one, logged(runs(layout, *model, mesh, "--data.init_args.batch_size=1")))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_equals_one_process_per_step(runs, layout):
    variant, overrides = LAYOUTS[layout]
    assert_same_steps(logged(runs(f"one_{variant}", *ONE_PROCESS[variant])), logged(runs(layout, *overrides)))


RESUMES = {
    # the frozen copy rebuilt from the pretrained weights (the run's start, not the checkpoint)
    "fsdp2_tp2": ('--trainer.strategy.mesh_shape=[[4, 1], ["fsdp", "tp"]]', "--data.init_args.batch_size=1"),
    # the precomputed log-probs read from the checkpoint (computed again, they would be the trained model's)
    "precomputed_fsdp2_cp2": (*PIPELINE, *FSDP_TP, ONE_PROCESS["precomputed"][-1]),
}


@pytest.mark.parametrize("layout", list(RESUMES))
def test_a_resume_in_another_layout_continues_the_run(runs, layout):
    """A step-3 checkpoint resumed in another layout (fsdp x tp on fsdp 4; fsdp x cp with precomputed reference
    log-probs on 1F1B pp 2 x fsdp 2): steps 3-5 equal the uninterrupted run's."""
    straight = runs(layout, *LAYOUTS[layout][1])
    ckpt = next(straight.rglob("epoch=0-step=3.ckpt"))
    resumed = runs(f"resumed_{layout}", *RESUMES[layout], f"--ckpt_path={ckpt}")
    files = sorted(resumed.rglob("metrics.csv"))
    with open(files[-1]) as f:
        rows = {int(row["step"]): row for row in csv.DictReader(f) if row.get("train_loss")}
    whole = logged(straight)
    assert sorted(rows) == [3, 4, 5]
    for step, row in rows.items():
        for key in LOGGED:
            want = whole[step][key]
            assert abs(float(row[key]) - want) <= 1e-5 * max(abs(want), 1.0), (step, key)


def validation(save_dir: Path) -> dict[int, dict[str, float]]:
    files = sorted(save_dir.rglob("metrics.csv"))
    with open(files[-1]) as f:
        rows = [row for row in csv.DictReader(f) if row.get("val_loss")]
    return {int(row["step"]): {f"val_{key}": float(row[f"val_{key}"]) for key in METRICS} for row in rows}


def test_validation_logs_trls_metrics_on_the_held_out_pairs_as_one_process(runs):
    """`val_loss`, `val_rewards/accuracies`, ...: the held-out pairs' metrics, averaged over the validation's batches
    (as TRL's evaluation), equal on fsdp x tp and one process; after training the model prefers the chosen more."""
    one = validation(runs("one_dpo", *ONE_PROCESS["dpo"]))
    layout = validation(runs("fsdp2_tp2", *LAYOUTS["fsdp2_tp2"][1]))
    assert sorted(one) == sorted(layout) == [2, 5]
    for step in one:
        for key, want in one[step].items():
            assert abs(layout[step][key] - want) <= 1e-5 * max(abs(want), 1.0), (step, key, want, layout[step][key])
    assert one[5]["val_rewards/margins"] > one[2]["val_rewards/margins"] > 0


SIMPO = ("--model.init_args.preference={loss_type: simpo, beta: 2.0, simpo_gamma: 0.5}",)


def test_simpo_is_its_published_formula(runs, sft_export):
    """SimPO (Meng et al. 2024, eq. 6; TRL's CPOTrainer with loss_type="simpo" and cpo_alpha=0 computes the same but
    tokenizes with its older pipeline): -log sigmoid(beta/|y_w| log pi(y_w|x) - beta/|y_l| log pi(y_l|x) - gamma), no
    reference. Step 0's loss and rewards from transformers' own forward on the first global batch. (Its distribution
    is DPO's without the reference: the layouts above.)"""
    one = logged(runs("one_simpo", *ONE, "--data.init_args.batch_size=4", *SIMPO))
    data = PreferenceDataModule(paths=str(sft_export.parent / "pairs.jsonl"), tokenizer=str(sft_export), batch_size=4)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(sft_export)).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    labels = batch["labels"]
    per_token = -F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    average = per_token.sum(-1) / labels.ne(-100).sum(-1)
    chosen, rejected = average.chunk(2)
    loss = -F.logsigmoid(2.0 * (chosen - rejected) - 0.5).mean()
    assert abs(one[0]["train_loss"] - loss.item()) <= 1e-5 * loss.item()
    assert abs(one[0]["rewards/chosen"] - 2.0 * chosen.mean().item()) <= 1e-5 * abs(2.0 * chosen.mean().item())
    assert one[0]["rewards/accuracies"] == (chosen > rejected).float().mean().item()


# -- bad input --------------------------------------------------------------------------------------------------------
PROMPT = [{"role": "user", "content": "What is 2 + 3?"}]
GOOD = {
    "prompt": PROMPT,
    "chosen": [{"role": "assistant", "content": "5"}],
    "rejected": [{"role": "assistant", "content": "6"}],
}
BAD = {
    "a row missing rejected": {"prompt": "Say hi", "chosen": "hi"},
    "chosen equal to rejected": {**GOOD, "rejected": GOOD["chosen"]},
    "a prompt that leaves no completion token": {**GOOD, "prompt": [{"role": "user", "content": "x" * 80}]},
}
THINKING = (  # a template whose generation prompt opens a block the rendered conversation does not have
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def bad_pairs(tmp_path: Path, rows: list) -> PreferenceDataModule:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return PreferenceDataModule(
        paths=str(path), tokenizer=str(builtin_tokenizer(tmp_path)), max_length=64, batch_size=1, val_fraction=0.0
    )


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_pair_is_refused_naming_its_line_and_the_fix(tmp_path, case):
    data = bad_pairs(tmp_path, [GOOD, BAD[case], GOOD])
    with pytest.raises(DataError) as refused:
        data.setup("fit")
    message = str(refused.value)
    assert "1 of the 3 preference records" in message and "pairs.jsonl line 2 " in message, message
    assert "Fix:" in message or "fix:" in message


def test_a_template_that_cannot_mark_the_completion_is_refused(tmp_path):
    data = bad_pairs(tmp_path, [GOOD, GOOD])
    data.chat_template = THINKING
    with pytest.raises(DataError, match=r"(?s)2 of the 2 .* line 1 renders its prompt alone .* line 2 renders"):
        data.setup("fit")


def test_every_bad_pair_is_named_in_one_refusal_before_launch(tmp_path):
    """`parallelkit fit` on a file holding each kind of bad pair: one message naming all of them, from the launching
    process, before any rank starts."""
    rows = [GOOD, *BAD.values(), GOOD]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    refused = fit(
        DPO,
        tmp_path / "run",
        f"--data.init_args.paths={path}",
        "--data.init_args.max_length=64",
        f"--data.init_args.tokenizer={builtin_tokenizer(tmp_path)}",
    )
    assert refused.returncode != 0
    output = refused.stdout + refused.stderr
    assert "3 of the 5 preference records" in output, output[-3000:]
    for line in (2, 3, 4):
        assert f"pairs.jsonl line {line} " in output
    assert output.count("cannot be trained on") == 1 and "Traceback" not in output


def test_pipelines_refuse_microbatches_that_split_a_pair_before_launch(tmp_path):
    """Each microbatch holds whole pairs: 3 pairs a step over 2 microbatches is refused in the launching process,
    with the batch size and the microbatches that fit."""
    refused = fit(
        DPO,
        tmp_path,
        "--trainer.strategy=parallelkit.PipelineStrategy",
        '--trainer.strategy.mesh_shape=[[2, 2], ["pp", "fsdp"]]',
        "--trainer.strategy.microbatches=2",
        "--data.init_args.batch_size=3",
    )
    assert refused.returncode != 0
    message = " ".join(refused.stderr.split())
    assert "a preference batch of 3 pairs (data.batch_size) under a pipeline of 2 microbatches" in message, message
    assert "--data.init_args.batch_size=2" in message and "Traceback" not in refused.stderr
    assert "Initializing distributed" not in refused.stdout + refused.stderr  # no worker started


@pytest.fixture(scope="module")
def guide_run(tmp_path_factory: pytest.TempPathFactory, sft_export: Path) -> tuple[Path, dict[str, str]]:
    """docs/guides/preference.md's command on the SFT export and its pairs, 6 steps on its 4 processes (LoRA on
    fsdp x tp), then its export; made once: `(the run's directory, the guide's paths as placed)`."""

    def make(directory: Path) -> None:
        place = where(directory)
        assert_ok(
            fit_command(
                parallelkit_args("dpo-from-sft", 0, **place),
                directory,
                f"--trainer.max_steps={STEPS}",
                "--model.init_args.warmup_steps=2",
                "--trainer.limit_val_batches=0",
                f"--trainer.callbacks.init_args.every_n_train_steps={STEPS}",  # the config's ModelCheckpoint
                *FSDP_TP,
            )
        )
        assert_ok(parallelkit(*parallelkit_args("dpo-from-sft", 1, **place), cwd=directory))

    def where(directory: Path) -> dict[str, str]:
        return {
            "/data/Qwen2.5-0.5B-Instruct-sft": str(sft_export),
            "/data/Qwen2.5-0.5B-Instruct-dpo": str(directory / "export"),
            "/data/pairs.jsonl": str(sft_export.parent / "pairs.jsonl"),
        }

    directory = made_once(tmp_path_factory, "preference-guide", make)
    return directory, where(directory)


def test_lora_on_fsdp_x_tp_equals_one_process_per_step(runs, guide_run):
    """The guide's run (rank-16 adapters on the attention, the reference the base with its adapters off)."""
    assert_same_steps(logged(runs("one_lora", *ONE_PROCESS["lora"])), logged(guide_run[0]))


def test_the_guides_command_tunes_an_sft_export_with_lora_and_exports_it(sft_export, guide_run):
    """The guide's export: a merged model transformers loads, with the tokenizer beside it, whose logits moved from
    the SFT model's."""
    export = Path(guide_run[1]["/data/Qwen2.5-0.5B-Instruct-dpo"])
    ids = torch.tensor([[258, *b"user\nWhat is 2 + 3?", 256, 10, 258, *b"assistant\n"]])
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(export)).eval()
    original = transformers.AutoModelForCausalLM.from_pretrained(str(sft_export)).eval()
    with torch.no_grad():
        logits = exported(ids).logits
        assert torch.isfinite(logits).all()
        assert (logits - original(ids).logits).abs().max() > 1e-4  # it trained
    assert (export / "tokenizer.json").is_file()


def test_precomputed_log_probs_of_other_pairs_are_refused_on_resume(tmp_path):
    """A checkpoint's precomputed reference log-probs are read back only for the pairs they were computed on: other
    data, or the same with another max_length, is refused naming what changed and the fix (the model they came
    from is gone: computed again they would be the trained model's)."""
    from types import SimpleNamespace

    from parallelkit.errors import ConfigError
    from parallelkit.models.preference_store import StoredReference

    records = [record for _, record in builtin_pairs(count=40, seed=1)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))

    def module(**options):
        data = PreferenceDataModule(paths=str(tmp_path / "pairs.jsonl"), cache_dir=str(tmp_path / "cache"), **options)
        data.setup("fit")
        trainer = SimpleNamespace(datamodule=data, strategy=SimpleNamespace(root_device=torch.device("cpu")))
        return SimpleNamespace(trainer=trainer)

    saved = module()
    digest = " ".join(getattr(saved.trainer.datamodule, f"{split}_set").digest() for split in ("train", "val"))
    state = {"digest": digest, "train": torch.zeros(38, 2), "val": torch.zeros(2, 2)}
    StoredReference().load_state_dict(state, saved)  # the same pairs: read back
    for changed in ({"max_length": 128}, {"truncation_mode": "keep_end"}):
        with pytest.raises(ConfigError, match=r"computed on other pairs than this run's .* Fix: resume with the data"):
            StoredReference().load_state_dict(state, module(**changed))
