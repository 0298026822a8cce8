import ast
import copy
import math

import pytest
import torch
from support import REPO, assert_ok, torchrun

from parallelkit.contract import matches
from parallelkit.errors import PlanError
from parallelkit.models import GPT
from parallelkit.models.gpt import rotary
from parallelkit.parallel import resolve
from parallelkit.parallel.fsdp import runnable_unit
from parallelkit.parallel.tensor_parallel import tp_styles


def test_gpt_forward_shapes_and_loss_near_uniform_at_init():
    torch.manual_seed(0)
    model = GPT(n_layer=2, n_head=4, n_embd=32)
    x = torch.randint(0, 256, (3, 16))
    logits = model(x)
    assert logits.shape == (3, 16, 256)
    loss = model.pipeline_loss(logits, x)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = GPT(n_layer=2, n_head=4, n_embd=32)
    x = torch.randint(0, 256, (1, 16))
    changed = x.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    torch.testing.assert_close(model(x)[:, :10], model(changed)[:, :10])


def test_rotary_table_is_one_operator_in_a_compiled_graph():
    """What torch.compile traces of rotary embedding: the cos/sin table as one operator (computed once per call),
    not the angle, cosine and sine, which inductor would fuse into the kernel rotating every element of q and k
    (measured: that made a compiled block slower than eager on CPU)."""
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(2, 4, 16, 8)
    assert torch.equal(torch.compile(rotary, backend=keep_graph, fullgraph=True)(x), rotary(x))
    traced = [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op.startswith("call")]
    assert any("rotary_table" in target for target in traced), traced
    assert not any(target.split(".")[-1] in ("cos", "sin") for target in traced), traced


def test_the_learning_rate_warms_up_linearly_then_decays_on_a_cosine_toward_its_floor_as_the_run_ends():
    """The configs' schedule past their 10 warmup steps, which the parity runs (`support.STEPS`: 6) never
    reach: the run's length (Lightning's `estimated_stepping_batches`, `max_steps` here) sets the decay."""
    from types import SimpleNamespace

    model = GPT(n_layer=1, n_head=2, n_embd=16, lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    model.trainer = SimpleNamespace(estimated_stepping_batches=12)
    configured = model.configure_optimizers()
    optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    rates = []
    for _ in range(12):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # linear warmup, the peak at its last step
    # Then the peak again and down over the 8 steps left, toward lr x min_lr_ratio, which the step after the run's
    # last would take.
    assert rates[4:] == pytest.approx([0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(8)])


def test_same_seed_gives_same_weights():
    torch.manual_seed(3)
    a = GPT(n_layer=2, n_head=4, n_embd=32)
    torch.manual_seed(3)
    b = GPT(n_layer=2, n_head=4, n_embd=32)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_glob_segments_never_cross_dots():
    assert matches("blocks.*.attn.q", "blocks.3.attn.q")
    assert not matches("blocks.*", "blocks.3.attn")
    assert not matches("blocks.*.q", "blocks.3.attn.q")


def test_tp_plan_expands_globs_per_block():
    model = GPT(n_layer=3, n_head=4, n_embd=32)
    plan = tp_styles(model, resolve(model, tp=2, sequence_parallel=True))
    assert "blocks.2.attn.q" in plan and "blocks.0.mlp.down" in plan and "head" in plan
    assert "blocks.1.attn_norm" in plan
    assert "blocks.1.attn_norm" not in tp_styles(model, resolve(model, tp=2, sequence_parallel=False))


def test_tp_not_dividing_heads_names_module_and_numbers():
    model = GPT(n_layer=1, n_head=6, n_embd=48)
    with pytest.raises(
        PlanError, match=r"GPT has 6 attention heads \(blocks\.0\.attn\), which tp=4.*mesh_shape \[\[-1, 2\]"
    ):
        resolve(model, tp=4)


def test_tp_not_dividing_width_names_module_and_numbers():
    model = GPT(vocab_size=255, n_layer=1, n_head=2, n_embd=32)
    with pytest.raises(PlanError, match=r"tok_emb \(vocab_embedding\) has num_embeddings=255.*tp=2"):
        resolve(model, tp=2)


def test_missing_tp_plan_explains_what_to_declare():
    model = copy.deepcopy(GPT(n_layer=1, n_head=2, n_embd=16))
    model.tp_plan = None
    with pytest.raises(PlanError, match="needs GPT.tp_plan"):
        resolve(model, tp=2)


def test_tp_plan_pattern_matching_nothing_is_an_error():
    model = GPT(n_layer=1, n_head=2, n_embd=16)
    model.tp_plan = {"blocks.*.attn.qkv": "colwise"}
    with pytest.raises(PlanError, match="'blocks.\\*.attn.qkv' matches no module"):
        resolve(model, tp=2)


def test_fsdp_units_declared_and_default_largest_module_list():
    model = GPT(n_layer=3, n_head=2, n_embd=16)
    assert resolve(model).fsdp_units == ["blocks.0", "blocks.1", "blocks.2"]
    model.fsdp_units = None
    assert resolve(model).fsdp_units == ["blocks.0", "blocks.1", "blocks.2"]


def test_a_unit_without_forward_is_sharded_as_its_children_or_refused_naming_it():
    block = torch.nn.ModuleDict({"attn": torch.nn.Linear(2, 2), "mlp": torch.nn.Linear(2, 2)})
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([block, torch.nn.ModuleDict({"parts": torch.nn.ModuleList([block])})])
    assert runnable_unit(type(model).__name__, "layers.0", model.layers[0]) == [block["attn"], block["mlp"]]
    with pytest.raises(
        PlanError, match=r"layers\.1 \(ModuleDict\) has no forward\(\).*child layers\.1\.parts.*'layers\.1\.parts\.\*'"
    ):
        runnable_unit(type(model).__name__, "layers.1", model.layers[1])
    model.pipeline_layers = ["layers.*"]
    with pytest.raises(PlanError, match=r"pipeline_layers entry layers\.0 \(ModuleDict\) has no forward\(\)"):
        resolve(model, num_stages=2)


def test_tp_planned_gpt_matches_plain_gpt_outputs_and_grads_on_4_processes():
    proc = torchrun("mesh_and_tp.py", 4, cwd=REPO)
    assert_ok(proc)
    assert proc.stdout.count("outputs equal") == 4 and "OK" in proc.stdout


MODEL_NAMES = {"GPT", "HFCausalLM", "CausalLM", "n_head", "num_heads", "num_key_value_heads"}
CONTRACT_ATTRIBUTES = {"tp_plan", "fsdp_units", "pipeline_layers", "pipeline_loss", "flops_per_token", "init_weights"}


def test_strategies_read_the_models_plan_and_name_no_model():
    """Strategies know a model only through its `ParallelPlan` (`parallelkit.contract`): no model class, no contract
    attribute read off the model, nothing imported from parallelkit.models."""
    for path in sorted((REPO / "src" / "parallelkit" / "strategies").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                assert node.id not in MODEL_NAMES, f"{path.name}:{node.lineno} names {node.id}"
            if isinstance(node, ast.Attribute):
                assert node.attr not in MODEL_NAMES | CONTRACT_ATTRIBUTES, (
                    f"{path.name}:{node.lineno} reads .{node.attr}"
                )
            if isinstance(node, ast.Constant) and isinstance(node.value, str):  # getattr(model, "tp_plan")
                assert node.value not in CONTRACT_ATTRIBUTES, f"{path.name}:{node.lineno} reads {node.value!r}"
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("parallelkit.models"), f"{path.name} imports {node.module}"
