"""The private Lightning and torch names parallelkit relies on: each listed here, each checked against the installed
versions, and none used outside `parallelkit.compat`. An upgrade that moves one fails here, naming it."""

import ast
import atexit
import importlib
import inspect
import io
import re
import tokenize
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.strategies import ModelParallelStrategy
from support import REPO, import_dotted
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from parallelkit import compat

CALLABLES = {
    "threading._shutdown": "()",
    "lightning.fabric.utilities.distributed._destroy_dist_connection": "()",
    "lightning.pytorch.strategies.ModelParallelStrategy._setup_distributed": "(self)",
    "lightning.pytorch.loops.fit_loop._FitLoop._should_accumulate": "(self)",
    "torch.distributed.device_mesh.DeviceMesh._flatten": "(self, mesh_dim_name=None, backend_override=None)",
    "torch.distributed._composable.checkpoint": "(module, **kwargs)",
    "torch.nn.Module._apply": "(self, fn, recurse=True)",
    "lightning.pytorch.callbacks.ModelCheckpoint._find_last_checkpoints": "(self, trainer)",
    "torch.distributed._functional_collectives.all_to_all_single_autograd": (
        "(self, output_split_sizes, input_split_sizes, group, tag='')"
    ),
    **compat.OVERRIDDEN,
}
"""Private functions and methods parallelkit calls or overrides, with the parameters it relies on."""


def parameters(function) -> str:
    """A signature as written above: names, `*`/`**` and defaults, no annotations."""
    shown = []
    for p in inspect.signature(function).parameters.values():
        star = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        shown.append(star + p.name + ("" if p.default is p.empty else f"={p.default!r}"))
    return f"({', '.join(shown)})"


@pytest.mark.parametrize("dotted", sorted(CALLABLES))
def test_private_callable_exists_with_the_signature_used(dotted):
    assert parameters(import_dotted(dotted)) == CALLABLES[dotted], f"{dotted} changed; parallelkit.compat relies on it"


def test_private_attributes_exist_on_the_objects_that_hold_them():
    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    assert isinstance(trainer.fit_loop._skip_backward, bool)  # compat.skip_loop_backward
    assert trainer._signal_connector.received_sigterm is False  # compat.note_sigterm
    assert ModelCheckpoint()._last_global_step_saved == 0  # compat.last_step_saved
    assert callable(trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor)  # compat.skip_sigterm_broadcast
    assert callable(atexit._run_exitfuncs)  # compat.exit_without_finalising (a builtin: no signature to compare)
    strategy = ModelParallelStrategy(save_distributed_checkpoint=False)
    assert strategy._device_mesh is None  # compat.set_device_mesh
    assert strategy._save_distributed_checkpoint is False  # compat.saves_distributed_checkpoint
    assert L.LightningModule()._device_mesh is None
    assert torch.nn.Module()._compiled_call_impl is None  # compat.run_as_forward
    assert "_flatten_mapping" in inspect.getsource(DeviceMesh)  # compat.flattened_meshes (set when a mesh is built)
    assert hasattr(compat.dispatch_mode_class(), "__torch_dispatch__")
    assert "_local_tensor" in DTensor.__annotations__  # compat.storage_key (building a DTensor needs a mesh)
    monitor = ThroughputMonitor(batch_size_fn=len)
    assert monitor._throughputs == {}  # compat.throughputs
    assert isinstance(torch._dynamo.config.capture_profiler_record_function, bool)  # compat.keep_profiler_ranges
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters())
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    assert optimizer.step._wrapped_by_lr_sched  # compat.keep_scheduler_mark
    # compat.logger_version, compat.set_logger_version (TensorBoard's logger keeps `_version` as CSV's, set by Lightning
    # Fabric's, but needs tensorboard installed to be built)
    from lightning.fabric.loggers import TensorBoardLogger as FabricTensorBoardLogger
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    assert issubclass(TensorBoardLogger, FabricTensorBoardLogger)
    assert "self._version = version" in inspect.getsource(FabricTensorBoardLogger.__init__)
    logger = CSVLogger("runs", version=3)
    assert compat.logger_version(CSVLogger("runs")) is None and compat.logger_version(logger) == 3
    compat.set_logger_version(logger, 5)
    assert logger.version == 5


def test_private_tensor_apis_still_answer():
    weight = torch.nn.Parameter(torch.ones(4, 2))
    assert compat.view_base(weight.t()) is weight and compat.view_base(weight) is weight
    a, b = torch.ones(3, device="meta"), torch.ones(3, device="meta")
    assert compat.storage_key(a)[1] == 12 and compat.storage_key(a) != compat.storage_key(b)  # not their address
    module = torch.nn.Linear(2, 2, device="meta")
    compat.apply_to_tensors(module, lambda t: torch.zeros_like(t, device="cpu"))
    assert module.weight.device.type == "cpu" and isinstance(module.weight, torch.nn.Parameter)
    q = torch.randn(1, 2, 4, 8)
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(compat.flash_attention_on_cpu(q, q, q, True, None), expected)
    block = torch.nn.Linear(2, 2)
    compat.composable_checkpoint(block)
    block(torch.ones(1, 2, requires_grad=True)).sum().backward()
    from torch.distributed._functional_collectives import AsyncCollectiveTensor  # compat.settle_async_collectives

    assert not compat.saved_tensors_hooks_active()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert compat.saved_tensors_hooks_active()
    x, w = torch.randn(6, 8), torch.randn(2, 4, 8)  # compat.grouped_mm: rows 0-2 by expert 0, 3-5 by expert 1
    expected = torch.cat([x[:3] @ w[0].T, x[3:] @ w[1].T])
    assert compat.grouped_mm_runs(x, w)
    torch.testing.assert_close(
        compat.grouped_mm(x, w.transpose(-2, -1), torch.tensor([3, 6], dtype=torch.int32)), expected
    )
    seen = []
    y = torch.ones(1, requires_grad=True) * 2
    y.register_hook(lambda grad: seen.append(compat.in_backward()))
    y.backward()
    assert seen == [True] and not compat.in_backward()
    assert "weight" in compat.registered_parameters(torch.nn.Linear(1, 1))
    pending = AsyncCollectiveTensor(torch.ones(2, requires_grad=True))
    settled = compat.settle_async_collectives({"x": (pending, 1)})
    assert type(settled["x"][0]) is torch.Tensor and settled["x"][1] == 1


def test_transformers_private_names_still_answer():
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", vocab_size=8, **sizes))
    assert compat.hf_tp_plan(model)["lm_head"] == "colwise_gather_output"  # `_tp_plan`, gathered by post_init
    assert list(compat.hf_pp_plan(model)) == ["model.embed_tokens", "model.layers", "model.norm", "lm_head"]
    weight = model.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        weight.zero_()
        model.initialize_weights()  # skips what it marked `_is_hf_initialized` when it built the model
        assert weight.eq(0).all()
        compat.hf_initialize(model)
    assert weight.std() > 0
    assert compat.hf_supports_sdpa(model.config)
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "head_dim": 8}
    experts = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", vocab_size=8, **sizes, **moe))
    assert compat.hf_ep_plan(experts)["model.layers.*.mlp.experts"] == "ep_dispatch_experts"
    converters = [t for t in compat.hf_conversions(experts) if type(t).__name__ == "WeightConverter"]
    assert any(t.target_patterns == ["mlp.experts.gate_up_proj"] for t in converters)
    assert not compat.hf_supports_sdpa(AutoConfig.for_model("gemma2"))


COMPAT = REPO / "src" / "parallelkit" / "compat"
SOURCES = [p for p in (REPO / "src").rglob("*.py") if p.parent != COMPAT] + list(REPO.glob("plugins/*/src/**/*.py"))


def module_of(path: Path):
    parts = path.relative_to(REPO).with_suffix("").parts
    dotted = ".".join(parts[parts.index("src") + 1 :])
    return importlib.import_module(dotted.removesuffix(".__init__"))


def private_uses(path: Path) -> list[str]:
    """`x._name` (x not self/cls) in code, not strings or comments, and imports of private names or modules from
    torch and lightning."""
    found = []
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline) if t.type != tokenize.NL]
    for before, dot, name in zip(tokens, tokens[1:], tokens[2:]):
        private = name.type == tokenize.NAME and name.string.startswith("_") and not name.string.startswith("__")
        if dot.string == "." and private and before.string not in ("self", "cls", ")"):
            found.append(f"{before.string}.{name.string}")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("torch", "lightning"):
            names = [node.module, *(alias.name for alias in node.names)]
            found += [n for n in names if any(part.startswith("_") for part in n.split("."))]
    return found


def lightning_private_names(cls: type) -> set[str]:
    """Private attributes and methods the Lightning classes in `cls`'s ancestry use or define."""
    names = set()
    for base in cls.__mro__:
        if base.__module__.startswith("lightning"):
            names |= set(re.findall(r"(?:self\.|def )(_[a-z]\w*)", inspect.getsource(base)))
    return names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_but_compat_reaches_for_a_private_name(path):
    assert not private_uses(path), f"{path}: route these through parallelkit.compat: {private_uses(path)}"
    overridden = {name.rsplit(".", 1)[1] for name in compat.OVERRIDDEN}
    module = module_of(path)
    for cls in vars(module).values():
        if not (isinstance(cls, type) and cls.__module__ == module.__name__):
            continue
        mine = set(re.findall(r"(?:self\.|super\(\)\.)(_[a-z]\w*)", inspect.getsource(cls)))
        shared = (mine & lightning_private_names(cls)) - overridden
        assert not shared, f"{cls.__name__} uses Lightning's private {sorted(shared)}: route through parallelkit.compat"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_override_of_a_lightning_method_is_marked(path):
    """As Lightning marks its own: a hook renamed upstream then fails loudly instead of never being called."""
    module = module_of(path)
    for cls in vars(module).values():
        if not (isinstance(cls, type) and cls.__module__ == module.__name__):
            continue
        for name, member in vars(cls).items():
            function = getattr(member, "fget", None) or getattr(member, "__func__", member)
            inherited = any(name in vars(b) for b in cls.__mro__[1:] if b.__module__.startswith("lightning"))
            if inherited and callable(function) and not name.startswith("__"):
                assert getattr(function, "__override__", False), (
                    f"{cls.__name__}.{name} overrides Lightning's: @override"
                )


def test_dcp_metadata_reads_through_the_globals_compat_allows(tmp_path):
    """Every global a DCP save writes into `.metadata` is one `compat.dcp_metadata_global` admits: a real checkpoint
    (tensors, a bytes value, a path) reads back equal to torch's own unpickling of it."""
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp

    from parallelkit.checkpoint import read_metadata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process on purpose
        dcp.save(
            {"w": torch.ones(2, 3, dtype=torch.bfloat16), "betas": (0.9, 0.95)}, checkpoint_id=tmp_path, no_dist=True
        )
    ours = read_metadata(tmp_path)
    theirs = pickle.loads((tmp_path / ".metadata").read_bytes())
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.storage_data == theirs.storage_data
    assert compat.dcp_metadata_global("torch", "load") is None and compat.dcp_metadata_global("os", "system") is None
