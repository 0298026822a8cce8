"""Files users hand us are untrusted: a checkpoint never runs code when read, and nothing parallelkit writes deletes
what the user had."""

import contextlib
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from models import TINY_LLAMA
from support import assert_ok, checkpoint_every, common, fit, parallelkit
from test_errors import assert_one_paragraph_error
from transformers import AutoConfig, AutoModelForCausalLM

from parallelkit.checkpoint import UnsafeCheckpointError, load_sharded, read_metadata
from parallelkit.models import HFCausalLM


class RunsCode:
    """Unpickled, runs `touch marker`: what a checkpoint from an untrusted source may carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def malicious_checkpoint(directory: Path, marker: Path) -> Path:
    """A checkpoint directory whose DCP `.metadata` pickle runs a command when read with `pickle.load`."""
    directory.mkdir(parents=True)
    (directory / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    return directory


HYBRID_2 = [
    "--trainer.devices=2",
    "--trainer.strategy.mesh_shape=[[2, 1], [fsdp, tp]]",
    "--data.init_args.batch_size=4",
]

PATHS = {
    "fit --ckpt_path DIR": lambda tmp, corpus, ckpt: fit(
        "hybrid.yaml", tmp / "log", *common(corpus, tmp / "cache", steps=1), f"--ckpt_path={ckpt}", timeout=120
    ),
    # Lightning resolves `last` inside the launched ranks: each of them reads the metadata.
    "fit --ckpt_path last": lambda tmp, corpus, ckpt: fit(
        "hybrid.yaml",
        tmp / "log",
        *common(corpus, tmp / "cache", steps=1),
        *HYBRID_2,
        checkpoint_every(ckpt.parent, 5),
        "--ckpt_path=last",
        timeout=180,
    ),
    "consolidate": lambda tmp, corpus, ckpt: parallelkit("consolidate", str(ckpt), str(tmp / "w.pt"), cwd=tmp),
    "export-hf": lambda tmp, corpus, ckpt: parallelkit("export-hf", str(ckpt), str(tmp / "hf"), cwd=tmp),
}


@pytest.mark.parametrize("path", PATHS)
def test_a_checkpoint_whose_metadata_names_code_is_refused_on_every_path_and_nothing_runs(tmp_path, corpus, path):
    marker = tmp_path / "ran"
    ckpt = malicious_checkpoint(tmp_path / "ckpt" / "last.ckpt", marker)
    proc = PATHS[path](tmp_path, corpus, ckpt)
    assert not marker.exists(), "the checkpoint's code ran"
    assert_one_paragraph_error(proc, ["last.ckpt/.metadata refers to posix.system", "nothing in it was run"])


def test_what_torch_would_run_in_a_checkpoint_parallelkit_refuses_by_name(tmp_path):
    """The same two carriers read in one process: `.metadata`, and a non-tensor value inside the shards (DCP's own
    planner unpickles values with weights_only=False). torch's own reader runs both; parallelkit's runs neither."""
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "ran"
    metadata = malicious_checkpoint(tmp_path / "metadata", marker)
    with pytest.raises(UnsafeCheckpointError, match=r"metadata/.metadata refers to posix.system"):
        read_metadata(metadata)
    assert not marker.exists()
    with contextlib.suppress(AttributeError):  # the payload ran, and returned os.system's exit status, not metadata
        FileSystemReader(str(metadata)).read_metadata()
    assert marker.exists()  # the carrier is real
    marker.unlink()

    shards = tmp_path / "shards"
    dcp.save({"weight": torch.ones(2), "betas": RunsCode(marker)}, checkpoint_id=str(shards), no_dist=True)
    assert not marker.exists()
    state = {"weight": torch.zeros(2), "betas": None}
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"value betas holds pickled Python objects \(posix.system\).* nothing in it was run",
    ):
        load_sharded(state, shards, no_dist=True)
    assert not marker.exists()
    dcp.load(state, checkpoint_id=str(shards), no_dist=True)
    assert marker.exists()


def tiny_hf_checkpoint(path: Path) -> HFCausalLM:
    """A single-file checkpoint of an HFCausalLM, as a run with save_distributed_checkpoint=false writes it."""
    model = HFCausalLM({"model_type": "llama", **TINY_LLAMA})
    torch.save({"state_dict": model.state_dict(), "hyper_parameters": dict(model.hparams)}, path)
    return model


def test_export_into_a_non_empty_directory_is_refused_and_overwrite_keeps_the_users_other_files(tmp_path):
    model = tiny_hf_checkpoint(tmp_path / "run.ckpt")
    out = tmp_path / "release"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "config.json").write_text("{}")  # a file an export writes: replaced only with --overwrite

    refused = parallelkit("export-hf", "run.ckpt", "release", cwd=tmp_path)
    assert_one_paragraph_error(refused, ["release already holds config.json, notes.txt", "--overwrite"])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "notes.txt"]
    assert (out / "config.json").read_text() == "{}"

    sharded = parallelkit("export-hf", "run.ckpt", "release", "--overwrite", "--max-shard-size=100KB", cwd=tmp_path)
    assert_ok(sharded)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    # Once more as one file: the earlier export's shards and index go, so transformers cannot read stale weights.
    assert_ok(parallelkit("export-hf", "run.ckpt", "release", "--overwrite", cwd=tmp_path))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(value, model.model.state_dict()[key]) for key, value in loaded.items())
    assert not list(tmp_path.glob(".release*")), "a staging directory was left behind"


def test_consolidate_replaces_an_existing_file_only_when_told(tmp_path):
    (tmp_path / "weights.pt").write_text("mine")
    ckpt = tmp_path / "ckpt"
    dcp.save({"state_dict.w": torch.ones(3)}, checkpoint_id=str(ckpt), no_dist=True)
    refused = parallelkit("consolidate", "ckpt", "weights.pt", cwd=tmp_path)
    assert_one_paragraph_error(refused, ["weights.pt already exists", "--overwrite"])
    assert (tmp_path / "weights.pt").read_text() == "mine"
    assert_ok(parallelkit("consolidate", "ckpt", "weights.pt", "--overwrite", cwd=tmp_path))
    assert torch.equal(torch.load(tmp_path / "weights.pt", weights_only=True)["w"], torch.ones(3))


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def header_only(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: 8 + int.from_bytes(data[:8], "little")])


def lfs_pointer(path: Path) -> None:
    oid = "4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393"
    path.write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {path.stat().st_size}\n")


DAMAGE = {
    "cut short": (cut_short, ["is cut short (a download that did not finish)"]),
    "header only": (header_only, ["is cut short (a download that did not finish)"]),
    "git-lfs pointer": (lfs_pointer, ["is a git-lfs pointer (", "bytes of text), not the weights", "git lfs pull"]),
}

LAYOUTS = {"one process": ["--trainer.devices=1", "--trainer.strategy.mesh_shape=[[1, 1], [fsdp, tp]]"], "2 x 2": []}


@pytest.fixture(scope="module")
def llama_directory(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY_LLAMA)).save_pretrained(directory)
    return directory


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_pretrained_weights_are_named_in_seconds_on_every_layout(tmp_path, llama_directory, damage, layout):
    """A weights file cut short used to hang every rank (a read loop waiting for bytes that never come)."""
    damaged = tmp_path / "llama"
    shutil.copytree(llama_directory, damaged)
    make_damage, fragments = DAMAGE[damage]
    make_damage(damaged / "model.safetensors")
    overrides = [f"--model.init_args.pretrained={damaged}", "--model.init_args.config=null", *LAYOUTS[layout]]
    proc = fit("hf_llama.yaml", tmp_path / "log", "--trainer.max_steps=1", *overrides, timeout=120)
    assert_one_paragraph_error(proc, ["llama/model.safetensors", *fragments, "Fix:"])


def test_weights_that_shrink_after_their_header_was_read_are_named_not_waited_for(llama_directory, tmp_path):
    from parallelkit.errors import ConfigError
    from parallelkit.models.hf_io import SafetensorsWeights

    shutil.copytree(llama_directory, tmp_path / "llama")
    weights = SafetensorsWeights(tmp_path / "llama")
    name = "model.norm.weight"
    whole = tuple(slice(0, n) for n in weights.shape(name))
    assert torch.equal(weights.read(name, whole), torch.ones(64))
    cut_short(tmp_path / "llama" / "model.safetensors")
    with pytest.raises(ConfigError, match=r"ended while reading .*: the file was cut short or changed"):
        weights.read(name, whole)
