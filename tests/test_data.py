"""The data contract loss parity rests on: one global sample order for every layout, resumable mid-epoch."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from parallelkit.data import GlobalBatchSampler, SyntheticDataModule, TextDataModule
from parallelkit.data import text as text_module
from parallelkit.errors import DataError

LAYOUTS = [(1, 8), (2, 4), (4, 2)]  # (num_replicas, batch_size), all with a global batch of 8


def global_batches(
    dataset_len: int, num_replicas: int, batch_size: int, epoch: int = 0, state: dict | None = None, **kwargs
) -> list[list[int]]:
    """Global batches as the ranks of a layout would read them: rank slices of batch k, concatenated."""
    per_rank = []
    for rank in range(num_replicas):
        sampler = GlobalBatchSampler(dataset_len, batch_size, num_replicas, rank, **kwargs)
        sampler.set_epoch(epoch)
        if state is not None:
            sampler.load_state_dict(state)
        indices = list(sampler)
        per_rank.append([indices[i : i + batch_size] for i in range(0, len(indices), batch_size)])
    return [sum(slices, []) for slices in zip(*per_rank, strict=True)]


def fake_trainer(epoch: int, processed: int, num_replicas: int = 1, rank: int = 0) -> SimpleNamespace:
    """The few Trainer attributes the datamodules read."""
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed))
    return SimpleNamespace(
        current_epoch=epoch,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": num_replicas, "rank": rank}),
    )


def batches(loader) -> list[torch.Tensor]:
    return [x for x, _ in loader]


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "pkg").mkdir(parents=True)
    (root / "a.py").write_bytes(bytes(range(256)) * 20)
    (root / "pkg" / "b.py").write_bytes(b"print('hello')\n" * 300)
    (root / "notes.txt").write_bytes(b"not matched by *.py")
    return root


PY = "*.py"  # the corpus's two .py files, not its notes.txt


# GlobalBatchSampler


@pytest.mark.parametrize("num_replicas,batch_size", LAYOUTS)
def test_global_batches_are_identical_for_every_layout_with_the_same_global_batch(num_replicas, batch_size):
    expected_order = torch.randperm(70, generator=torch.Generator().manual_seed(3 + 2)).tolist()
    expected = [expected_order[k * 8 : (k + 1) * 8] for k in range(70 // 8)]
    assert global_batches(70, num_replicas, batch_size, epoch=2, seed=3) == expected


def test_unshuffled_sampler_keeps_dataset_order_and_drops_the_tail():
    assert sum(global_batches(21, 2, 4, shuffle=False), []) == list(range(16))


def test_epochs_reshuffle_and_the_same_seed_repeats_the_order():
    assert global_batches(64, 2, 4, epoch=0) != global_batches(64, 2, 4, epoch=1)
    assert global_batches(64, 2, 4, epoch=1, seed=7) == global_batches(64, 2, 4, epoch=1, seed=7)
    assert global_batches(64, 2, 4, seed=7) != global_batches(64, 2, 4, seed=8)


def test_len_counts_a_full_epoch_of_complete_global_batches_even_when_resuming():
    sampler = GlobalBatchSampler(70, batch_size=4, num_replicas=2, rank=1)
    assert len(sampler) == (70 // 8) * 4
    sampler.load_state_dict({"epoch": 0, "samples_seen": 24})
    assert len(sampler) == 32
    assert len(list(sampler)) == 32 - 3 * 4


@pytest.mark.parametrize("num_replicas,batch_size", LAYOUTS)
def test_resume_after_k_batches_continues_the_uninterrupted_run_under_any_layout(num_replicas, batch_size):
    uninterrupted = global_batches(70, 2, 4, epoch=1)
    state = GlobalBatchSampler(70, batch_size=4, num_replicas=2, rank=0).state_dict(batches_done=3)
    state["epoch"] = 1
    assert state == {"epoch": 1, "samples_seen": 24}
    assert global_batches(70, num_replicas, batch_size, epoch=1, state=state) == uninterrupted[3:]


def test_resume_offset_applies_once_then_epochs_start_at_zero():
    sampler = GlobalBatchSampler(64, batch_size=4)
    sampler.load_state_dict({"epoch": 0, "samples_seen": 8})
    assert len(list(sampler)) == 64 - 8
    assert len(list(sampler)) == 64


def test_resume_at_epoch_end_continues_at_the_start_of_the_next_epoch():
    sampler = GlobalBatchSampler(70, batch_size=4, num_replicas=2)
    sampler.load_state_dict({"epoch": 1, "samples_seen": 64})
    assert sampler.epoch == 2
    assert global_batches(70, 2, 4, state={"epoch": 1, "samples_seen": 64}) == global_batches(70, 2, 4, epoch=2)


def test_resume_at_a_sample_that_splits_the_new_global_batch_is_refused():
    sampler = GlobalBatchSampler(64, batch_size=8, num_replicas=2)
    with pytest.raises(DataError, match=r"samples_seen=24.*global batches of 16"):
        sampler.load_state_dict({"epoch": 0, "samples_seen": 24})


def test_dataset_smaller_than_one_global_batch_is_refused():
    with pytest.raises(DataError, match=r"7 samples.*global batch of 8 \(batch_size 4 x data-parallel size 2\)"):
        GlobalBatchSampler(7, batch_size=4, num_replicas=2)


def test_rank_outside_the_data_parallel_group_is_refused():
    with pytest.raises(DataError, match=r"rank 2 .* size 2"):
        GlobalBatchSampler(64, batch_size=4, num_replicas=2, rank=2)


def test_batch_size_below_one_is_refused():
    with pytest.raises(DataError, match="batch_size is 0"):
        GlobalBatchSampler(64, batch_size=0)


# TextDataModule


def test_text_samples_are_next_byte_pairs_over_the_sorted_matching_files(corpus, tmp_path):
    dm = TextDataModule(paths=str(corpus), pattern=PY, seq_len=16, batch_size=4, cache_dir=str(tmp_path / "cache"))
    dm.setup("fit")
    stream = (corpus / "a.py").read_bytes() + (corpus / "pkg" / "b.py").read_bytes()
    assert dm.num_bytes == len(stream)
    x, y = dm.train_set[3]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
    assert x.tolist() == list(stream[48:64]) and y.tolist() == list(stream[49:65])


def test_text_split_is_contiguous_and_deterministic(corpus, tmp_path):
    def splits():
        dm = TextDataModule(paths=[str(corpus)], pattern=PY, seq_len=16, val_fraction=0.25, cache_dir=str(tmp_path))
        dm.setup("fit")
        return np.asarray(dm.train_set.tokens), np.asarray(dm.val_set.tokens)

    (train, val), (train_again, val_again) = splits(), splits()
    assert len(train) == int((len(train) + len(val)) * 0.75)
    assert np.array_equal(train, train_again) and np.array_equal(val, val_again)
    stream = (corpus / "a.py").read_bytes() + (corpus / "pkg" / "b.py").read_bytes()
    assert bytes(train) + bytes(val) == stream


def test_a_directory_of_text_is_read_whole_by_default(corpus, tmp_path):
    """A user's directory of text files, whatever their names: every file, in sorted path order; hidden ones (a
    repository's .git, .DS_Store) left out."""
    (corpus / ".git").mkdir()
    (corpus / ".git" / "index").write_bytes(b"\x00binary")
    (corpus / ".DS_Store").write_bytes(b"\x00")
    dm = TextDataModule(paths=str(corpus), seq_len=16, cache_dir=str(tmp_path))
    dm.setup("fit")
    stream = b"".join((corpus / name).read_bytes() for name in ("a.py", "notes.txt", "pkg/b.py"))
    assert bytes(dm.train_set.tokens) + bytes(dm.val_set.tokens) == stream


def test_text_second_setup_reuses_the_cached_corpus(corpus, tmp_path, monkeypatch):
    TextDataModule(paths=str(corpus), cache_dir=str(tmp_path)).setup("fit")
    assert len(list(tmp_path.glob("*.bin"))) == 1

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached corpus was rebuilt")

    monkeypatch.setattr(text_module, "write_atomically", no_rebuild)
    dm = TextDataModule(paths=str(corpus), cache_dir=str(tmp_path))
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) > 0


def test_text_default_corpus_is_the_standard_library_and_over_a_megabyte(tmp_path):
    dm = TextDataModule(cache_dir=str(tmp_path))
    dm.setup("fit")
    assert dm.num_bytes > 1_000_000
    assert len(dm.files()) > 10 and all(p.suffix == ".py" for p in dm.files())


def test_text_windows_survive_pickling_for_spawned_workers(corpus, tmp_path):
    dm = TextDataModule(paths=str(corpus), seq_len=16, val_fraction=0.25, cache_dir=str(tmp_path))
    dm.setup("fit")
    restored = pickle.loads(pickle.dumps(dm.val_set))
    assert isinstance(restored.tokens, np.memmap)
    assert all(torch.equal(a, b) for a, b in zip(restored[2], dm.val_set[2], strict=True))


def test_text_missing_path_is_refused_with_the_path(tmp_path):
    with pytest.raises(DataError, match="nowhere"):
        TextDataModule(paths=str(tmp_path / "nowhere"), cache_dir=str(tmp_path)).setup("fit")


def test_text_empty_corpus_is_refused_with_the_byte_count(tmp_path):
    (tmp_path / "empty.py").write_bytes(b"")
    with pytest.raises(DataError, match="0 bytes"):
        TextDataModule(paths=str(tmp_path / "empty.py"), cache_dir=str(tmp_path)).setup("fit")


def test_text_corpus_smaller_than_a_global_batch_is_refused_with_the_numbers(tmp_path):
    (tmp_path / "tiny.py").write_bytes(b"x" * 1000)
    dm = TextDataModule(paths=str(tmp_path / "tiny.py"), seq_len=32, batch_size=8, cache_dir=str(tmp_path))
    dm.setup("fit")
    dm.trainer = fake_trainer(epoch=0, processed=0, num_replicas=4)
    with pytest.raises(DataError, match=r"1000 bytes.*29 samples.*global batch of 32"):
        dm.train_dataloader()


def test_text_loaders_read_this_ranks_slice_of_each_global_batch(corpus, tmp_path):
    def first_global_batch(num_replicas: int, batch_size: int) -> torch.Tensor:
        slices = []
        for rank in range(num_replicas):
            dm = TextDataModule(paths=str(corpus), seq_len=16, batch_size=batch_size, cache_dir=str(tmp_path))
            dm.trainer = fake_trainer(epoch=0, processed=0, num_replicas=num_replicas, rank=rank)
            dm.setup("fit")
            slices.append(next(iter(dm.train_dataloader()))[0])
        return torch.cat(slices)

    assert all(torch.equal(first_global_batch(1, 8), first_global_batch(n, b)) for n, b in LAYOUTS[1:])


# Resume through the datamodule checkpoint hooks


@pytest.mark.parametrize(
    "make",
    [
        lambda tmp_path, corpus: TextDataModule(paths=str(corpus), seq_len=16, batch_size=4, cache_dir=str(tmp_path)),
        lambda tmp_path, corpus: SyntheticDataModule(seq_len=16, batch_size=4, num_samples=64, val_samples=8),
    ],
    ids=["text", "synthetic"],
)
def test_datamodule_state_round_trip_restarts_the_train_loader_at_the_next_batch(make, tmp_path, corpus):
    dm = make(tmp_path, corpus)
    assert dm.state_dict() == {}
    dm.trainer = fake_trainer(epoch=1, processed=3)
    dm.setup("fit")
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(1)
    uninterrupted = batches(loader)
    state = dm.state_dict()
    assert state == {"epoch": 1, "samples_seen": 12}

    resumed = make(tmp_path, corpus)
    resumed.trainer = fake_trainer(epoch=0, processed=0)
    resumed.load_state_dict(state)
    resumed.setup("fit")
    loader = resumed.train_dataloader()
    assert len(loader) == len(uninterrupted)
    loader.sampler.set_epoch(1)
    assert all(torch.equal(a, b) for a, b in zip(batches(loader), uninterrupted[3:], strict=True))
    assert len(batches(loader)) == len(uninterrupted)


def test_synthetic_data_is_identical_on_every_rank_and_differs_by_seed():
    def tokens(seed: int) -> np.ndarray:
        dm = SyntheticDataModule(seq_len=8, seed=seed, num_samples=32, val_samples=8)
        dm.setup("fit")
        return np.concatenate([dm.train_set.tokens, dm.val_set.tokens])

    assert np.array_equal(tokens(1), tokens(1))
    assert not np.array_equal(tokens(1), tokens(2))


def test_synthetic_val_split_follows_the_train_split_without_sharing_a_window():
    dm = SyntheticDataModule(seq_len=8, vocab_size=50, num_samples=32, val_samples=8)
    dm.setup("fit")
    assert (len(dm.train_set), len(dm.val_set)) == (32, 8)
    assert torch.equal(dm.train_set[31][1][-1], dm.val_set[0][0][0])
    assert int(dm.train_set.tokens.max()) < 50
