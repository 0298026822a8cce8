"""Instruction fine-tuning (`parallelkit.data.SFTDataModule`): chat templates as transformers renders them, targets on
the assistant's tokens only, packing that keeps examples apart, and the loss of a step the token mean of its global
batch in every layout (per step equal to one process's)."""

import json
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
import yaml
from models import TINY_LLAMA
from snippets import parallelkit_args, snippet
from support import (
    REPO,
    SFT_GPT,
    SFT_ONE_PROCESS,
    assert_ok,
    assert_same_losses,
    fit_command,
    parallelkit,
    step_losses,
)

from parallelkit.contract import IGNORE_INDEX
from parallelkit.data import SFTDataModule
from parallelkit.data.chat import ChatEncoder, builtin_conversations, builtin_tokenizer, load_tokenizer
from parallelkit.data.packing import StepTargetSampler
from parallelkit.errors import DataError
from parallelkit.models import GPT, HFCausalLM

SFT = "sft.yaml"
CONFIG = yaml.safe_load((REPO / "configs" / SFT).read_text())

TWO_TURNS = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And reversed, 'cat'?"},
    {"role": "assistant", "content": "tac"},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return builtin_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def module(tmp_path: Path, **kwargs) -> SFTDataModule:
    dm = SFTDataModule(cache_dir=str(tmp_path / "cache"), **kwargs)
    dm.setup("fit")
    return dm


# -- templates and targets --------------------------------------------------------------------------------------
LLAMA3_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.mark.parametrize("template", [None, LLAMA3_STYLE], ids=["tokenizers_own", "given_in_the_config"])
def test_a_two_turn_conversation_renders_as_transformers_does_and_only_assistant_turns_are_targets(
    tmp_path, tokenizer_dir, template
):
    dm = module(
        tmp_path,
        paths=str(write_jsonl(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}] * 40)),
        tokenizer=str(tokenizer_dir),
        chat_template=template,
        packing=False,
        val_fraction=0.0,
        seq_len=512,  # the second template's markers are not special tokens here: spelled out in bytes
    )
    reference = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    expected = reference.apply_chat_template(TWO_TURNS, chat_template=template)["input_ids"]
    row = dm.train_set[0]
    ids, labels, positions = row["input_ids"], row["labels"], row["position_ids"]
    assert ids[: len(expected)].tolist() == expected
    assert positions[: len(expected)].tolist() == list(range(len(expected)))
    # The targets, read back: each assistant turn's text and the template's end of turn, nothing else.
    targets = labels[labels != IGNORE_INDEX]
    end = "<|im_end|>" if template is None else "<|eot_id|>"  # the separator after ChatML's end of turn is not one
    assert reference.decode(targets) == f"2 + 3 = 5.{end}tac{end}"
    # Each target is the next token of the conversation.
    shown = (labels != IGNORE_INDEX).nonzero().flatten()
    assert torch.equal(labels[shown], ids[shown + 1])


MARKED_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The built-in ChatML template with its assistant tokens marked as TRL's templates mark Qwen's."""


@pytest.mark.parametrize("template", [MARKED_CHATML, None], ids=["generation_blocks", "unmarked_chatml"])
def test_assistant_targets_are_transformers_assistant_tokens_mask(tokenizer_dir, template):
    """transformers' `return_assistant_tokens_mask` on the marked template is the reference: the targets of a template
    with `{% generation %}` blocks are its mask, and those of the same layout unmarked (the built-in template) follow
    the same convention (each assistant turn's content and its `<|im_end|>`, not the newline after it)."""
    tokenizer = load_tokenizer(tokenizer_dir)
    encoder = ChatEncoder(tokenizer, template, "assistant", str(tokenizer_dir))
    conversations = [TWO_TURNS, TWO_TURNS[1:3], [*TWO_TURNS[:2], {"role": "assistant", "content": "  five \n"}]]
    for messages in conversations:
        reference = tokenizer.apply_chat_template(
            messages, chat_template=MARKED_CHATML, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, targets = encoder.encode({"messages": messages}, "a record")
        assert ids.tolist() == reference["input_ids"]
        assert targets.astype(int).tolist() == reference["assistant_masks"], messages
    # A prompt/completion pair of turns: the prompt's assistant turn is not a target.
    pair = {"prompt": TWO_TURNS[:3], "completion": TWO_TURNS[3:]}
    ids, targets = encoder.encode(pair, "a record")
    assert tokenizer.decode(ids[targets]) == "tac<|im_end|>"


def test_train_on_all_and_prompt_completion_pairs(tmp_path, tokenizer_dir):
    records = [{"prompt": "Capital of France? ", "completion": "Paris"}] * 40
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    pair = module(tmp_path, paths=str(path), tokenizer=str(tokenizer_dir), packing=False, val_fraction=0.0)
    tokenizer = load_tokenizer(tokenizer_dir)
    labels = pair.train_set[0]["labels"]
    assert tokenizer.decode(labels[labels != IGNORE_INDEX]) == "Paris<|im_end|>"  # the completion, then EOS
    every = module(
        tmp_path / "all", paths=str(path), tokenizer=str(tokenizer_dir), packing=False, val_fraction=0.0, train_on="all"
    )
    ids = tokenizer("Capital of France? Paris", add_special_tokens=False)["input_ids"]
    assert int(every.train_set.targets[0]) == len(ids)  # every token after the first (and EOS)


# -- packing -----------------------------------------------------------------------------------------------------
def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=264, n_layer=2, n_head=4, n_embd=64).eval()


def llama() -> HFCausalLM:
    torch.manual_seed(0)
    return HFCausalLM(config={"model_type": "llama", **TINY_LLAMA, "vocab_size": 264}).eval()


@pytest.mark.parametrize("make_model", [gpt, llama], ids=["gpt", "hf_llama"])
def test_packed_examples_have_the_losses_they_have_alone(tmp_path, make_model):
    """No token attends across an example boundary: each example's per-token losses inside a packed row equal those
    of the example run alone, unpadded; the same row without its positions (one causal sequence) differs."""
    dm = module(tmp_path, seq_len=256)
    model = make_model()
    rows = [dm.train_set[i] for i in range(4)]
    batch = {key: torch.stack([row[key] for row in rows]) for key in ("input_ids", "labels", "position_ids")}
    with torch.no_grad():
        packed = F.cross_entropy(
            model(batch["input_ids"], batch["position_ids"]).transpose(1, 2), batch["labels"], reduction="none"
        )
        examples = 0
        for r in range(4):
            positions = batch["position_ids"][r]
            starts = [*(positions == 0).nonzero().flatten().tolist(), len(positions)]
            for a, b in zip(starts, starts[1:]):
                alone = model(batch["input_ids"][r : r + 1, a:b])
                expected = F.cross_entropy(alone[0], batch["labels"][r, a:b], reduction="none")
                torch.testing.assert_close(packed[r, a:b], expected, rtol=1e-5, atol=1e-5)
                examples += 1
        whole = F.cross_entropy(model(batch["input_ids"]).transpose(1, 2), batch["labels"], reduction="none")
    assert examples > 8  # several examples per row
    assert (whole - packed).abs().max() > 1e-3


def test_a_pipeline_stage_hands_packed_positions_on(tmp_path):
    """The GPT's and HFCausalLM's stage forwards, run as two stages one after the other, give the whole model's
    logits of packed rows."""
    dm = module(tmp_path, seq_len=256)
    ids = torch.stack([dm.train_set[i]["input_ids"] for i in range(2)])
    positions = torch.stack([dm.train_set[i]["position_ids"] for i in range(2)])
    for model in (gpt(), llama()):
        plan = model.parallel_plan()
        layers = [(name, model.get_submodule(name)) for name in _expand(model, plan.pipeline_layers)]
        with torch.no_grad():
            first = plan.stage_forward(layers[:2], ids, positions)
            logits = plan.stage_forward(layers[2:], *first)
            torch.testing.assert_close(logits, model(ids, positions), rtol=1e-5, atol=1e-5)


def _expand(model, globs):
    from parallelkit.contract import matches

    names = [name for name, _ in model.named_modules()]
    return [name for glob in globs for name in names if matches(glob, name)]


def test_long_examples_are_truncated_or_dropped_and_counted(tmp_path, tokenizer_dir):
    records = [{"prompt": "q" * n, "completion": "a" * 10} for n in (5, 50, 300, 8)] * 10
    path = write_jsonl(tmp_path / "long.jsonl", records)
    cut = module(tmp_path, paths=str(path), tokenizer=str(tokenizer_dir), seq_len=64, batch_size=1, val_fraction=0)
    assert cut.report["overlong"] == 10 and cut.report["longest"] == 311  # 300 + 10 + EOS
    assert cut.report["train_targets"] == 30 * 11  # the long prompts' completions are cut off whole
    dropped = module(
        tmp_path / "d",
        paths=str(path),
        tokenizer=str(tokenizer_dir),
        seq_len=64,
        batch_size=1,
        val_fraction=0,
        overlong="drop",
    )
    assert dropped.report["train_targets"] == 30 * 11 and dropped.report["overlong"] == 10
    assert dropped.train_set.real_tokens < cut.train_set.real_tokens


# -- sources ------------------------------------------------------------------------------------------------------
def test_a_datasets_directory_and_parquet_and_arrow_files_load_as_the_jsonl_does(tmp_path, tokenizer_dir):
    import datasets

    records = [record for _, record in builtin_conversations(count=60)]
    jsonl = module(tmp_path / "j", paths=str(write_jsonl(tmp_path / "c.jsonl", records)), tokenizer=str(tokenizer_dir))
    table = datasets.Dataset.from_list(records)
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "dict"))
    table.to_parquet(str(tmp_path / "c.parquet"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for path in (tmp_path / "saved", tmp_path / "dict", tmp_path / "c.parquet", arrow):
        other = module(tmp_path / f"m-{path.name}", paths=str(path), tokenizer=str(tokenizer_dir))
        assert len(other.train_set) == len(jsonl.train_set), path
        for i in range(len(jsonl.train_set)):
            assert torch.equal(other.train_set[i]["labels"], jsonl.train_set[i]["labels"]), path


BAD = {
    "no assistant turn": ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant turn"),
    "unknown role": (
        {"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        "has the role 'human'",
    ),
    "missing fields": ({"text": "hi"}, "neither 'messages' nor 'prompt' and 'completion'"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_records_are_refused_naming_the_file_and_line(tmp_path, tokenizer_dir, case):
    record, message = BAD[case]
    good = {"messages": TWO_TURNS}
    path = write_jsonl(tmp_path / "chat.jsonl", [good, good, record])
    with pytest.raises(DataError, match=message) as error:
        module(tmp_path, paths=str(path), tokenizer=str(tokenizer_dir))
    assert f"{path} line 3" in str(error.value) and "Fix:" in str(error.value)


def test_a_tokenizer_without_a_chat_template_is_refused_with_the_fix(tmp_path, tokenizer_dir):
    plain = load_tokenizer(tokenizer_dir)
    plain.chat_template = None
    plain.save_pretrained(str(tmp_path / "plain"))
    (tmp_path / "plain" / "chat_template.jinja").unlink(missing_ok=True)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}])
    with pytest.raises(DataError, match="has no chat template") as error:
        module(tmp_path, paths=str(path), tokenizer=str(tmp_path / "plain"))
    assert f"{path} line 1" in str(error.value) and "data.chat_template" in str(error.value)


# -- the token mean --------------------------------------------------------------------------------------------------
def test_each_sample_carries_its_optimizer_steps_target_count_in_every_layout():
    targets = np.random.default_rng(0).integers(0, 50, size=64)

    def steps(num_replicas: int, batch_size: int, accumulate: int) -> list[tuple[set, int]]:
        """Per optimizer step: the samples of every rank, and the count every rank was handed."""
        per_rank = [
            list(
                StepTargetSampler(targets, accumulate, batch_size=batch_size, num_replicas=num_replicas, rank=r, seed=3)
            )
            for r in range(num_replicas)
        ]
        size = batch_size * accumulate
        out = []
        for start in range(0, len(per_rank[0]), size):
            items = [item for rank in per_rank for item in rank[start : start + size]]
            assert len({count for _, count in items}) == 1
            out.append(({index for index, _ in items}, items[0][1]))
        return out

    one = steps(1, 8, 1)
    assert all(count == targets[list(indices)].sum() for indices, count in one)
    assert steps(4, 1, 2) == one and steps(2, 4, 1) == one and steps(2, 2, 2) == one


def test_a_resumed_sampler_continues_with_the_uninterrupted_samples_and_counts():
    """Resumed after 3 optimizer steps of 2 micro-batches (in another layout), the samples and their step counts
    are the uninterrupted run's from there on."""
    targets = np.random.default_rng(1).integers(0, 50, size=64)
    whole = list(StepTargetSampler(targets, 2, batch_size=4, num_replicas=2, rank=0, seed=5))
    before = StepTargetSampler(targets, 2, batch_size=4, num_replicas=2, rank=0, seed=5)
    state = before.state_dict(batches_done=6)  # 3 steps x 2 micro-batches
    after = [StepTargetSampler(targets, 2, batch_size=2, num_replicas=4, rank=r, seed=5) for r in range(4)]
    for sampler in after:
        sampler.load_state_dict(state)
    resumed = [list(sampler) for sampler in after]
    # Global micro-batch k of the resumed run: ranks 0-3's k-th pair of samples; the uninterrupted rank 0 held the
    # first half of each global micro-batch of 8.
    for k in range(len(resumed[0]) // 2):
        ranks = [pair for rank in resumed for pair in rank[2 * k : 2 * k + 2]]
        assert ranks[:4] == whole[4 * (6 + k) : 4 * (6 + k) + 4]


@pytest.fixture
def runs(sft_runs):
    return sft_runs


LAYOUTS = {
    "2x2_sequence_parallel": (),  # the config's own layout: 4 rows per process, tp ranks share them
    "fsdp4_accumulate2": (
        '--trainer.strategy.mesh_shape=[[4, 1], ["fsdp", "tp"]]',
        "--data.init_args.batch_size=1",
        "--trainer.accumulate_grad_batches=2",
    ),
    "1f1b_pp2": (
        "--trainer.strategy=parallelkit.PipelineStrategy",
        '--trainer.strategy.mesh_shape=[[2], ["pp"]]',
        "--trainer.strategy.schedule=1f1b",
        "--trainer.strategy.microbatches=4",
        "--trainer.devices=2",
        "--data.init_args.batch_size=8",
    ),
}


GPT_LAYOUTS = {
    "1f1b_pp2": LAYOUTS["1f1b_pp2"],
    # Context parallelism: each packed row split over the cp ranks, its documents crossing the slices' edges.
    "fsdp2_cp2": ('--trainer.strategy.mesh_shape=[[2, 2], ["fsdp", "cp"]]', "--data.init_args.batch_size=4"),
    "cp4": ('--trainer.strategy.mesh_shape=[[1, 4], ["fsdp", "cp"]]', "--data.init_args.batch_size=8"),
}


@pytest.mark.parametrize("name", [*LAYOUTS, *(f"gpt_{name}" for name in GPT_LAYOUTS)])
def test_packed_sft_matches_one_process_per_step(runs, name):
    if name.startswith("gpt_"):
        expected = runs("gpt_one", *SFT_ONE_PROCESS, *SFT_GPT)
        actual = runs(name, *GPT_LAYOUTS[name.removeprefix("gpt_")], *SFT_GPT)
    else:
        expected, actual = runs("one", *SFT_ONE_PROCESS), runs(name, *LAYOUTS[name])
    assert_same_losses(step_losses(expected), step_losses(actual))


def test_the_step_loss_is_the_global_token_mean_not_a_mean_of_rank_means(runs, tmp_path):
    """Step 0 (the seed's weights): the rows of the global batch hold very different numbers of targets, so the
    token mean and the mean of per-process means differ by far more than the tolerance; every layout logged the
    token mean (one process too, and [[4, 1]] x 2 micro-batches, where each rank's micro-batch is one row)."""
    L.seed_everything(CONFIG["seed_everything"])
    model = HFCausalLM(**CONFIG["model"]["init_args"]).eval()
    dm = module(tmp_path, batch_size=8)
    batch = next(iter(dm.train_dataloader()))
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"])
    per_token = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
    counts = batch["labels"].ne(IGNORE_INDEX).sum(1)
    sums = per_token.sum(1)
    token_mean = (sums.sum() / counts.sum()).item()
    rank_means = (sums / counts).mean().item()  # [[4, 1]] x 2: one row per rank per micro-batch
    assert counts.max() >= 3 * counts.min() and int(batch["num_targets"]) == counts.sum()
    assert abs(rank_means - token_mean) > 20 * 1e-5 * token_mean
    for name in ("one", *LAYOUTS):
        logged = step_losses(runs(name, *(SFT_ONE_PROCESS if name == "one" else LAYOUTS[name])))[0]
        assert abs(logged - token_mean) <= 1e-5 * token_mean, name


def test_the_worked_example_fits_a_pretrained_model_on_a_jsonl_file_and_exports_it(tmp_path, tokenizer_dir):
    """The guide's example (docs/guides/sft.md): a pretrained directory with its tokenizer and chat template,
    conversations in a JSONL file, `parallelkit fit`, `parallelkit export-hf`, and its Python answering a chat with the
    export (the export's logits against parallelkit's are checked in test_hf_io.py)."""
    pretrained, export, run = tmp_path / "pretrained", tmp_path / "export", tmp_path / "run"
    config = transformers.LlamaConfig(**{**TINY_LLAMA, "vocab_size": 264})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(pretrained))
    load_tokenizer(tokenizer_dir).save_pretrained(str(pretrained))
    data = write_jsonl(tmp_path / "chats.jsonl", [record for _, record in builtin_conversations(count=300, seed=1)])
    place = {
        "/data/Qwen2.5-0.5B-Instruct-sft": str(export),
        "/data/Qwen2.5-0.5B-Instruct": str(pretrained),
        "/data/chats.jsonl": str(data),
    }
    assert_ok(
        fitted := fit_command(
            parallelkit_args("sft-finetune", 0, **place),
            run,
            f"--data.init_args.cache_dir={tmp_path / 'cache'}",
            "--data.init_args.batch_size=8",
            "--trainer.devices=1",
            '--trainer.strategy.mesh_shape=[[1, 1], ["fsdp", "tp"]]',
            "--trainer.max_steps=6",
            "--trainer.limit_val_batches=0",
            "--trainer.callbacks.init_args.every_n_train_steps=6",  # the config's ModelCheckpoint
            "--trainer.precision=bf16-true",  # as fine-tuning is usually run: SFT's bf16 run
        )
    )
    assert f"SFT data: 300 examples: 285 train, 15 validation (['{data}'])" in fitted.stdout + fitted.stderr
    assert_ok(parallelkit(*parallelkit_args("sft-finetune", 1, **place), cwd=run))
    answered: dict = {}
    exec(snippet("sft-chat").text.replace("/data/Qwen2.5-0.5B-Instruct-sft", str(export)), answered)
    exported, tokenizer = answered["model"].eval(), answered["tokenizer"]  # the template travelled
    assert answered["answer"].numel() > 0
    ids = torch.tensor([tokenizer.apply_chat_template(TWO_TURNS)["input_ids"]])
    original = transformers.AutoModelForCausalLM.from_pretrained(str(pretrained)).eval()
    with torch.no_grad():
        logits = exported(ids).logits
        assert torch.isfinite(logits).all()
        assert (logits - original(ids).logits).abs().max() > 1e-3  # it trained
