"""TokenizedDataModule: real tokenizers and token arrays under the data contract of every parallelkit datamodule
(one global sample order for every layout, resumable mid-epoch), tokenized once into a memory-mapped cache."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from parallelkit.data import TokenizedDataModule
from parallelkit.data import tokenized as tokenized_module
from parallelkit.errors import DataError

EOS = "<|endoftext|>"
WORDS = ["the", "model", "reads", "every", "token", "once", "and", "each", "rank", "takes", "its", "global", "batch"]


def document(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + ".\n"


def fake_trainer(
    num_replicas: int = 1, rank: int = 0, epoch: int = 0, processed: int = 0, model_vocab_size: int | None = None
) -> SimpleNamespace:
    """The few Trainer attributes the datamodules read, and a model that may have a vocab_size."""
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed))
    model = SimpleNamespace() if model_vocab_size is None else SimpleNamespace(vocab_size=model_vocab_size)
    return SimpleNamespace(
        current_epoch=epoch,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": num_replicas, "rank": rank}),
        lightning_module=model,
    )


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer trained here on generated text, saved as transformers saves one."""
    rng = random.Random(0)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([document(rng, 50) for _ in range(200)], trainer=trainer)
    root = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return root


@pytest.fixture
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


@pytest.fixture
def docs(tmp_path: Path) -> tuple[Path, list[str]]:
    """Two text files and a JSONL file of three documents (and a blank line), in the order the stream reads them."""
    rng = random.Random(1)
    root = tmp_path / "docs"
    root.mkdir()
    texts = [document(rng, 120) for _ in range(5)]
    (root / "a.txt").write_text(texts[0])
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(texts[1:4])]
    (root / "b.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + lines[2] + "\n")
    (root / "c.md").write_text(texts[4])
    return root, texts


def make(docs_dir: Path, tokenizer_dir: Path, cache: Path, **kwargs) -> TokenizedDataModule:
    options = {"seq_len": 16, "batch_size": 4, "cache_dir": str(cache), **kwargs}
    return TokenizedDataModule(paths=str(docs_dir), tokenizer=str(tokenizer_dir), **options)


def stream(dm: TokenizedDataModule) -> np.ndarray:
    return np.concatenate([np.asarray(dm.train_set.tokens), np.asarray(dm.val_set.tokens)])


def test_documents_are_the_tokenizers_encodings_each_followed_by_eos(docs, tokenizer_dir, tokenizer, tmp_path):
    root, texts = docs
    dm = make(root, tokenizer_dir, tmp_path / "cache")
    dm.setup("fit")
    eos = tokenizer.token_to_id(EOS)
    expected = sum((tokenizer.encode(text).ids + [eos] for text in texts), [])
    assert dm.eos_id == eos and dm.vocab_size == tokenizer.get_vocab_size()
    assert stream(dm).tolist() == expected
    assert dm.train_set.tokens.dtype == np.uint16 and isinstance(dm.train_set.tokens, np.memmap)
    assert int((stream(dm) == eos).sum()) == len(texts)
    x, y = dm.train_set[5]
    assert x.tolist() == expected[80:96] and y.tolist() == expected[81:97]


def test_explicit_eos_overrides_the_tokenizer_config_and_a_missing_one_is_refused(docs, tokenizer_dir, tmp_path):
    root, _ = docs
    dm = make(root, tokenizer_dir, tmp_path / "cache", eos_token="e")
    dm.setup("fit")
    assert dm.eos_id == Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id("e")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    with pytest.raises(DataError, match=r"No EOS token for the tokenizer .*bare.*data.eos_token"):
        make(root, bare, tmp_path / "cache").setup("fit")
    explicit = make(root, bare, tmp_path / "cache", eos_id=7)
    explicit.setup("fit")
    assert explicit.eos_id == 7 and int((stream(explicit) == 7).sum()) >= 5


@pytest.mark.parametrize("num_replicas,batch_size", [(2, 4), (4, 2)])
def test_global_batches_are_identical_for_data_parallel_sizes_1_2_and_4(
    docs, tokenizer_dir, tmp_path, num_replicas, batch_size
):
    def global_batches(num_replicas: int, batch_size: int) -> list[torch.Tensor]:
        per_rank = []
        for rank in range(num_replicas):
            dm = make(docs[0], tokenizer_dir, tmp_path / "cache", batch_size=batch_size, val_fraction=0.1)
            dm.trainer = fake_trainer(num_replicas, rank)
            dm.setup("fit")
            per_rank.append([x for x, _ in dm.train_dataloader()])
        return [torch.cat(slices) for slices in zip(*per_rank, strict=True)]

    single = global_batches(1, 8)
    assert len(single) >= 4
    assert all(torch.equal(a, b) for a, b in zip(single, global_batches(num_replicas, batch_size), strict=True))


def test_resume_after_k_batches_continues_at_the_uninterrupted_runs_next_batch(docs, tokenizer_dir, tmp_path):
    dm = make(docs[0], tokenizer_dir, tmp_path / "cache")
    dm.trainer = fake_trainer(epoch=1, processed=3)
    dm.setup("fit")
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(1)
    uninterrupted = [x for x, _ in loader]
    state = dm.state_dict()
    assert state == {"epoch": 1, "samples_seen": 12}

    resumed = make(docs[0], tokenizer_dir, tmp_path / "cache", batch_size=2)
    resumed.trainer = fake_trainer(num_replicas=2, rank=1)
    resumed.load_state_dict(state)
    resumed.setup("fit")
    loader = resumed.train_dataloader()
    loader.sampler.set_epoch(1)
    assert torch.equal(next(iter(loader))[0], uninterrupted[3][2:])


def test_bin_and_npy_token_arrays_give_the_arrays_own_windows_without_a_tokenizer(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 1000, 16 * 40 + 1).astype(np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    np.save(tmp_path / "train.npy", tokens.astype(np.int32))
    for name in ("train.bin", "train.npy"):
        dm = TokenizedDataModule(paths=str(tmp_path / name), seq_len=16, val_fraction=0.0, cache_dir=str(tmp_path))
        dm.setup("fit")
        assert dm.token_file == tmp_path / name  # one array alone is mapped where it is, not copied
        assert len(dm.train_set) == 40 and dm.vocab_size == int(tokens.max()) + 1
        for i in (0, 17, 39):
            x, y = dm.train_set[i]
            assert x.tolist() == tokens[16 * i : 16 * i + 16].tolist()
            assert y.tolist() == tokens[16 * i + 1 : 16 * i + 17].tolist()
    both = TokenizedDataModule(paths=str(tmp_path / "train.*"), val_fraction=0.0, cache_dir=str(tmp_path / "c"))
    both.setup("fit")
    assert stream(both).dtype == np.uint16
    assert stream(both).tolist() == tokens.tolist() * 2  # train.bin, then train.npy: arrays are joined as they are


def test_token_arrays_and_tokenized_text_share_one_stream(docs, tokenizer_dir, tokenizer, tmp_path):
    root, texts = docs
    ids = np.arange(300, 310, dtype=np.uint16)
    ids.tofile(root / "z.bin")
    dm = make(root, tokenizer_dir, tmp_path / "cache")
    dm.setup("fit")
    eos = tokenizer.token_to_id(EOS)
    assert stream(dm).tolist() == sum((tokenizer.encode(text).ids + [eos] for text in texts), []) + ids.tolist()


def test_a_jsonl_line_without_the_text_field_is_refused_naming_file_line_and_field(tokenizer_dir, tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "fine"}\n\n{"body": "no text here"}\n')
    with pytest.raises(DataError, match=r"data\.jsonl line 3 has no string field 'text' \(it holds \['body'\]\)"):
        make(path, tokenizer_dir, tmp_path / "cache").setup("fit")
    dm = make(path, tokenizer_dir, tmp_path / "cache", text_field="body", seq_len=2, batch_size=1)
    with pytest.raises(DataError, match=r"line 1 has no string field 'body'"):
        dm.setup("fit")


def test_an_id_beyond_the_models_vocabulary_is_refused_with_both_numbers(docs, tokenizer_dir, tmp_path):
    dm = make(docs[0], tokenizer_dir, tmp_path / "cache")
    dm.trainer = fake_trainer(model_vocab_size=256)
    with pytest.raises(DataError, match=r"token id 3\d\d .*model's vocab_size is 256.*vocab_size >= 3\d\d"):
        dm.setup("fit")
    dm.trainer = fake_trainer(model_vocab_size=320)
    dm.setup("fit")

    array = tmp_path / "ids.npy"
    np.save(array, np.array([1, 2, 70_000, 3] * 20, dtype=np.int64))
    arrays = TokenizedDataModule(paths=str(array), seq_len=4, batch_size=2, cache_dir=str(tmp_path / "cache"))
    arrays.trainer = fake_trainer(model_vocab_size=65_536)
    with pytest.raises(DataError, match=r"token id 70000 \(in .*ids\.npy.*vocab_size is 65536"):
        arrays.setup("fit")


@pytest.mark.parametrize(
    "paths,tokenizer,match",
    [
        ("nowhere", None, r"data.paths entry .*nowhere.* matches no file"),
        ("docs", "no_tokenizer_here", r"data.tokenizer .*no_tokenizer_here.* not a directory holding tokenizer.json"),
        ("docs", None, r"4 text or JSONL files to tokenize .* data.tokenizer is not set"),
        ("empty.txt", "tokenizer", r"The corpus .*empty.txt.* is empty \(0 tokens"),
        ("odd.bin", None, r"odd.bin is 3 bytes, an odd number"),
        ("matrix.npy", None, r"matrix.npy holds a int64 array of shape \(2, 2\)"),
    ],
)
def test_bad_sources_are_refused_naming_them(docs, tokenizer_dir, tmp_path, paths, tokenizer, match):
    (docs[0] / "d.txt").write_text("a fourth text file")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    np.save(tmp_path / "matrix.npy", np.zeros((2, 2), dtype=np.int64))
    (tmp_path / "no_tokenizer_here").mkdir()
    places = {"docs": docs[0], "tokenizer": tokenizer_dir}
    tokenizer_arg = None if tokenizer is None else str(places.get(tokenizer, tmp_path / tokenizer))
    dm = TokenizedDataModule(
        paths=str(places.get(paths, tmp_path / paths)), tokenizer=tokenizer_arg, cache_dir=str(tmp_path / "cache")
    )
    with pytest.raises(DataError, match=match):
        dm.setup("fit")


def test_too_few_samples_for_a_global_batch_is_refused_with_the_token_count(docs, tokenizer_dir, tmp_path):
    dm = make(docs[0], tokenizer_dir, tmp_path / "cache", seq_len=64, batch_size=64)
    dm.setup("fit")
    with pytest.raises(DataError, match=rf"train split .*\({dm.num_tokens} tokens.*global batch of 64"):
        dm.train_dataloader()


def test_the_cache_is_built_once_and_reused_and_named_by_what_changes_the_tokens(
    docs, tokenizer_dir, tmp_path, monkeypatch
):
    cache = tmp_path / "cache"
    first = make(docs[0], tokenizer_dir, cache)
    first.prepare_data()
    first.setup("fit")
    assert sorted(p.suffix for p in cache.iterdir()) == [".bin", ".json"]

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cache was rebuilt")

    monkeypatch.setattr(tokenized_module, "write_atomically", no_rebuild)
    monkeypatch.setattr(Tokenizer, "from_file", no_rebuild)
    again = make(docs[0], tokenizer_dir, cache)
    again.prepare_data()
    again.setup("fit")
    again.setup("validate")
    assert np.array_equal(stream(again), stream(first)) and again.eos_id == first.eos_id
    monkeypatch.undo()

    make(docs[0], tokenizer_dir, cache, eos_id=5).setup("fit")  # another separator: other tokens
    (docs[0] / "a.txt").write_text("edited")  # another size and mtime
    make(docs[0], tokenizer_dir, cache).setup("fit")
    assert len(list(cache.glob("*.bin"))) == 3


def test_windows_survive_pickling_for_workers_with_their_dtype(docs, tokenizer_dir, tmp_path):
    dm = make(docs[0], tokenizer_dir, tmp_path / "cache", val_fraction=0.25)
    dm.setup("fit")
    wide = np.arange(70_000, 70_000 + 16 * 8, dtype=np.int64)
    np.save(tmp_path / "wide_a.npy", wide)
    np.save(tmp_path / "wide_b.npy", wide)
    arrays = TokenizedDataModule(paths=str(tmp_path / "wide_*.npy"), seq_len=16, cache_dir=str(tmp_path / "cache"))
    arrays.setup("fit")  # two arrays: copied into one uint32 cache
    for dataset, dtype in ((dm.val_set, np.uint16), (arrays.train_set, np.uint32)):
        restored = pickle.loads(pickle.dumps(dataset))
        assert isinstance(restored.tokens, np.memmap) and restored.tokens.dtype == dtype
        assert all(torch.equal(a, b) for a, b in zip(restored[1], dataset[1], strict=True))
