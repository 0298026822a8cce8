"""`parallelkit plan`: estimates held to measurements on CPU and to hand arithmetic for sizes no machine here runs."""

import dataclasses
import json
from dataclasses import replace

import pytest
import torch
from rich.text import Text
from snippets import parallelkit_args, snippet
from support import REPO, assert_ok, common, fit, in_repo, parallelkit, step_losses

from parallelkit.callbacks.activations import SavedTensorWindow
from parallelkit.cli.plan import PLAN_COLUMNS, PLAN_TABLE_OMITS, PLAN_WIDTH, memory_headroom, plan_parser
from parallelkit.compat import composable_checkpoint
from parallelkit.errors import ConfigError, PlanError
from parallelkit.init import meta_parameters
from parallelkit.mesh import MeshSpec
from parallelkit.models import GPT
from parallelkit.models.gpt import Block
from parallelkit.parallel.resolve import resolve, split_stages
from parallelkit.planner import Estimate, Hardware, Workload, estimate, estimate_layout, profile, recommend, workloads
from parallelkit.planner.search import candidates

GPT70B = {"vocab_size": 32000, "n_layer": 80, "n_head": 64, "n_embd": 8192}


def reference_gpt_on_meta() -> GPT:
    with torch.device("meta"):
        return GPT(n_layer=2, n_head=4, n_embd=64)  # the configs' model


@pytest.mark.parametrize(
    ("config", "overrides", "mesh", "micro_batch", "schedule", "checkpointing"),
    [
        (
            "hybrid.yaml",
            ['--trainer.strategy.mesh_shape=[[4, 1], ["fsdp", "tp"]]', "--data.init_args.batch_size=2"],
            '[[4, 1], ["fsdp", "tp"]]',
            2,
            None,
            "none",
        ),
        ("hybrid.yaml", [], '[[2, 2], ["fsdp", "tp"]]', 4, None, "none"),
        ("1f1b.yaml", [], '[[2, 1, 1], ["pp", "fsdp", "tp"]]', 8, "1f1b", "none"),
        (
            "hybrid.yaml",
            ["--trainer.strategy.activation_checkpointing=full"],
            '[[2, 2], ["fsdp", "tp"]]',
            4,
            None,
            "full",
        ),
    ],
)
def test_estimated_peak_is_within_12_percent_of_the_memory_monitor(
    tmp_path, corpus, config, overrides, mesh, micro_batch, schedule, checkpointing
):
    """The planner's tensor peak (state + activations) against RankMonitor's CPU figure for the same run: the state
    exactly where every rank holds the same (no pipeline), the whole within 12% (measured: [[4, 1]] +0.8%, [[2, 2]]
    -4.6%, 1F1B pp=2 -11.1%, [[2, 2]] with every block checkpointed +0.6%). Both count activations with the saved-tensor
    ledger, which test_saved_tensor_ledger_counts_what_one_gpt_block_keeps_for_backward holds to a hand count."""
    assert_ok(fit(config, tmp_path, *common(corpus, tmp_path / "cache", steps=3), *overrides))
    measured = max(step_losses(tmp_path, "memory/peak_mb").values()) * 2**20  # RankMonitor, largest rank
    measured_state = set(step_losses(tmp_path, "memory/state_mb").values())

    model = reference_gpt_on_meta()
    prof = profile(model, seq_len=64, tp_degrees=(1, 2))
    spec = MeshSpec.parse(mesh)
    stages = None
    if spec.size("pp") > 1:
        by_name = {layer.name: layer for layer in prof.layers}
        stages = [[by_name[n] for n in s] for s in split_stages(model, [x.name for x in prof.layers], spec.size("pp"))]
    work = Workload(64, micro_batch, activation_checkpointing=checkpointing)
    e = estimate(prof, spec, work, Hardware(1, 4, 1e12), schedule, 4 if schedule else None, stages)
    if schedule is None:  # every rank holds the same state (pipeline stages do not)
        assert measured_state == {e.state / 2**20}  # exact: a multiple of 1/4096 MB
    print(f"{mesh} {checkpointing}: estimate / measured = {e.tensor_peak / measured:.3f}")
    assert e.tensor_peak == pytest.approx(measured, rel=0.12), (e.as_dict(), measured)


def test_saved_tensor_ledger_counts_what_one_gpt_block_keeps_for_backward():
    """The ledger behind RankMonitor's and ActivationMemoryMonitor's CPU activation figures, and the planner's, held
    to a count by hand of what autograd (torch 2.13, CPU) saves in one reference-GPT block: on a real batch, and in
    the planner's meta profile of the configs' model. Parameters are not counted; a storage saved twice counts once."""
    batch, seq, d, heads, hidden = 2, 8, 64, 4, 4 * 64
    head_dim = d // heads

    def by_hand(batch: int) -> int:
        n = batch * seq  # tokens
        saved = {  # elements
            "attn_norm (RMSNorm): its input x, x * rsqrt(mean(x^2) + eps), and rsqrt(...)": 2 * n * d + n,
            "attn.q, attn.k, attn.v: their one input, attn_norm's output": n * d,
            "rotary on q and on k: cos and sin (seq x head_dim / 2 each)": 2 * 2 * seq * head_dim // 2,
            "attention (CPU flash kernel): rotated q and k, v, the output": 4 * n * d,
            "attention: the log-sum-exp per head and position": batch * heads * seq,
            "attn.proj: its input, the heads merged back (a copy)": n * d,
            "mlp_norm: its input (the residual sum), x * rsqrt, and rsqrt": 2 * n * d + n,
            "mlp.up: its input, mlp_norm's output": n * d,
            "gelu: its input, up's output": n * hidden,
            "mlp.down: its input, gelu's output": n * hidden,
        }
        return 4 * sum(saved.values())  # fp32

    torch.manual_seed(0)
    block = Block(d, heads, mlp_ratio=4)
    x = torch.randn(batch, seq, d, requires_grad=True) * 1.0  # an activation (a leaf would count as a parameter)
    window = SavedTensorWindow()
    window.start()
    y = block(x)
    assert window.stop() == by_hand(batch) == 79_232
    y.sum().backward()  # what was counted is what backward needs

    prof = profile(reference_gpt_on_meta(), seq_len=seq)  # per sample: a batch of one
    by_name = {layer.name: layer.activations for layer in prof.layers}
    assert by_name["blocks.0"] == by_name["blocks.1"] == by_hand(1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_the_planner_assumes_the_pipeline_strategys_default_microbatches(schedule):
    """On pp=2, left to its default, the planner estimates the microbatches `PipelineStrategy` runs with no
    `microbatches` given (2 x the stages: 4, and 8 for interleaved_1f1b's 2 stages per rank), in `estimate` and in
    `recommend`; and the count matters to the estimate (half as many gives other figures)."""
    import lightning as L

    from parallelkit import PipelineStrategy

    strategy = PipelineStrategy(mesh_shape=[[2], ["pp"]], schedule=schedule)
    L.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False, enable_checkpointing=False)
    assert strategy.microbatches == 2 * 2 * (2 if schedule == "interleaved_1f1b" else 1)
    with torch.device("meta"):
        model = GPT(n_layer=6, n_head=4, n_embd=64)
    prof = profile(model, seq_len=64, tp_degrees=(1, 2))
    by_name = {layer.name: layer for layer in prof.layers}
    names = split_stages(model, [layer.name for layer in prof.layers], strategy.num_stages)
    stages = [[by_name[n] for n in stage] for stage in names]
    spec, work, hw = MeshSpec((2, 1, 1), ("pp", "fsdp", "tp")), Workload(64, 16), Hardware(1, 2, 1e12)
    strategys = estimate(prof, spec, work, hw, schedule, strategy.microbatches, stages)
    assert estimate(prof, spec, work, hw, schedule, None, stages) == strategys
    assert estimate(prof, spec, work, hw, schedule, strategy.microbatches // 2, stages) != strategys
    if schedule != "gpipe":  # the schedules recommend weighs
        estimates, _, _ = recommend(model, work, hw)
        (recommended,) = [e for e in estimates if (e.mesh, e.schedule) == (str(spec), schedule)]
        assert recommended == strategys


def test_the_ledger_counts_what_a_checkpointed_block_keeps_and_recomputes():
    """Under activation checkpointing autograd calls checkpoint's saved-tensor hooks, not the ledger's. A window given
    the model counts the input a checkpointed block keeps (after forward: that alone) and, in backward, what its
    recomputation saves: for one block whose output nothing else needs, the peak is then exactly the plain block's."""
    torch.manual_seed(0)
    batch, seq, d = 2, 8, 64
    block = Block(d, 4, mlp_ratio=4)
    leaf = torch.randn(batch, seq, d, requires_grad=True)
    plain = SavedTensorWindow()
    plain.start()
    block(leaf * 1.0).sum().backward()  # `* 1.0`: an activation (a leaf would count as a parameter)
    assert plain.stop() == 79_232  # the hand count of the test above
    composable_checkpoint(block)
    window = SavedTensorWindow()
    window.start(block)
    y = block(leaf * 1.0)
    assert window._ledger.live == window._ledger.peak == 4 * batch * seq * d  # the kept input
    y.sum().backward()
    assert window.stop() == 79_232


def test_70b_on_four_nodes_of_eight_80gb_devices_recommends_a_layout_that_fits():
    with torch.device("meta"):
        model = GPT(**GPT70B)
    params = sum(p.numel() for p in model.parameters())
    # Hand arithmetic: 80 blocks of 12 d^2 weights + 2 d norms; embedding and head V d each; a final norm.
    d, v = 8192, 32000
    assert params == 80 * (12 * d * d + 2 * d) + 2 * v * d + d
    norms = 80 * 2 * d + d  # tp replicates norms and shards every matrix
    work, hw = Workload(seq_len=4096, micro_batch=8, compute_bytes=2), Hardware(4, 8, 80e9)
    estimates, best, reason = recommend(model, work, hw)
    assert best is not None and best.fits and best.peak <= 0.9 * 80e9 and "fits in" in reason  # the headroom kept
    by_mesh = {(e.mesh, e.schedule): e for e in estimates}
    for fsdp, tp in ((32, 1), (4, 8)):
        e = by_mesh[(str(MeshSpec((fsdp, tp), ("fsdp", "tp"))), None)]
        shard = ((params - norms) / tp + norms) / fsdp
        # Integers below 2^53 (every count divides by tp and fsdp here): exact in floating point.
        assert e.params == 4 * shard  # fp32 weights
        assert e.grads == 4 * shard
        assert e.optimizer == 8 * shard  # AdamW: two fp32 moments
        # FSDP gathers, in the 2-byte compute dtype, the root (embedding, head, final norm) and two blocks at once.
        root, block = 2 * v * d / tp + d, 12 * d * d / tp + 2 * d
        assert e.gathered == 2 * (root + 2 * block)
    assert not by_mesh[('[[32, 1], ["fsdp", "tp"]]', None)].fits  # 820 GB of activations without tp or pp

    # Searched, as `parallelkit plan` searches: checkpointing and a smaller micro-batch (accumulated to the same 8
    # samples per step) make pure FSDP fit; a recomputed forward costs a third more compute per checkpointed block.
    tried = workloads(work)
    assert {(w.micro_batch * w.accumulate, w.activation_checkpointing) for w in tried} == {
        (8, "none"),
        (8, 2),
        (8, "full"),
    }
    searched = {(e.mesh, e.schedule): e for e in recommend(model, work, hw, search=tried)[0]}
    fsdp32 = searched[('[[32, 1], ["fsdp", "tp"]]', None)]
    assert fsdp32.fits and fsdp32.activation_checkpointing != "none"
    spec = MeshSpec((4, 8), ("fsdp", "tp"))
    prof = profile(model, work.seq_len, (1, 8))
    plain, full = (estimate(prof, spec, replace(work, activation_checkpointing=ac), hw) for ac in ("none", "full"))
    assert full.activations < plain.activations / 10 and full.state == plain.state and full.comm == plain.comm
    compute = prof.flops_per_token * work.seq_len * work.micro_batch / 8 / (hw.device_tflops * 1e12 * hw.mfu)
    assert full.step_s - plain.step_s == pytest.approx(compute * 80 * (12 * d * d + 2 * d) / params / 3)
    # With pipelines too, the fastest that fits is pp x tp without recomputation; without them (fsdp_tp), it
    # checkpoints.
    _, best, _ = recommend(model, work, hw, pipeline=False, search=tried)
    assert best.fits and best.activation_checkpointing != "none", best


def assert_fits_the_width(stdout: str) -> None:
    lines = stdout.splitlines()
    assert max(len(line) for line in lines) <= PLAN_WIDTH, [line for line in lines if len(line) > PLAN_WIDTH]


def test_plan_command_prints_every_mesh_and_the_recommendation(tmp_path):
    """The planning guide's command: the table within 120 characters with each layout's axes, the hardware assumed and
    the global batch above it; every layout at the config's global batch, 8 per process x 32 processes (the config has
    no mesh: every process data-parallel), so its step time and tokens/s say the same; the recommendation within the
    memory less the 10% headroom."""
    args = in_repo(parallelkit_args("plan-70b"))  # the planning guide's command
    named = ("--trainer.strategy=fsdp_tp", "--trainer.strategy.meta_init=true")  # a registered name takes options
    table = parallelkit(*args, cwd=tmp_path)
    assert_ok(table)
    assert_fits_the_width(table.stdout)
    out = " ".join(table.stdout.split())
    assert "recommended: " in out and "<- best" in out
    assert "Every layout trains the same global batch: 256 samples of 4096 tokens a step" in out
    assert "data.batch_size 8 x accumulate_grad_batches 1 x dp 32 (every process data-parallel)" in out
    assert (
        "Assumed: 4 x 8 devices of 80.00 GB, 72.00 GB usable (10% headroom); 200 GB/s in a node, 25 GB/s across nodes; "
        "400 TFLOP/s peak at 40% MFU." in out
    )
    for mesh in ("│ fsdp=32 ", "│ replicate=4 tp=8 ", "│ pp=4 fsdp=2 tp=4 "):
        assert mesh in table.stdout
    printed = {line.rstrip() for line in table.stdout.splitlines()}
    shown = snippet("plan-70b-output").text.splitlines()  # the guide's copy of the output's head
    assert [line for line in shown if line not in printed] == []
    proc = parallelkit(*args, *named, "--json", cwd=tmp_path)  # fsdp_tp's mesh_shape auto: every process shards
    assert_ok(proc)
    report = json.loads(proc.stdout)
    assert report["hardware"]["memory_headroom"] == 0.1 and report["workload"]["global_batch"] == 256
    for e in report["estimates"]:
        assert e["micro_batch"] * e["accumulate"] * e["data_parallel"] == e["global_batch"] == 256
        assert e["tokens_per_s"] * e["step_s"] == pytest.approx(256 * 4096)
    assert report["recommended"]["fits"] and report["recommended"]["peak"] <= 0.9 * 80e9
    assert f"recommended: {report['recommended']['mesh']}" in out


def test_plan_table_and_json_hold_every_field_of_an_estimate(tmp_path):
    """Every column of the table shows planner fields under its own header, and the JSON holds every field; a field
    added to the planner but neither to a column nor to PLAN_TABLE_OMITS, or a cell added without a header, fails
    here. The table fits in 120 characters, a row a line."""
    args = ["plan", "--config", str(REPO / "configs" / "hybrid.yaml"), "--devices-per-node", "4", "--device-memory"]
    table, as_json = (
        parallelkit(*args, "1GB", cwd=tmp_path),
        parallelkit(*args, "1GB", "--json", cwd=tmp_path),
    )
    assert_ok(table)
    assert_ok(as_json)
    assert_fits_the_width(table.stdout)
    report = json.loads(as_json.stdout)
    estimates = report["estimates"]
    shown = {field for column in PLAN_COLUMNS for field in column.fields}
    assert not shown & PLAN_TABLE_OMITS
    for e in estimates:
        assert {field.name for field in dataclasses.fields(Estimate)} <= set(e)
        assert set(e) == shown | PLAN_TABLE_OMITS
    lines = table.stdout.splitlines()
    headers = [cell.strip() for cell in next(line for line in lines if line.startswith("┃")).split("┃")[1:-1]]
    assert headers == [column.header for column in PLAN_COLUMNS]
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in lines if line.startswith("│")]
    assert len(rows) == len(estimates) > 1
    for row, e in zip(rows, estimates):
        expected = [Text.from_markup(column.cell(*(e[f] for f in column.fields))).plain for column in PLAN_COLUMNS]
        if e == report["recommended"]:
            expected[headers.index("fits")] = "<- best"
        assert row == expected


def test_plan_help_states_every_default():
    """`parallelkit plan --help`: every option says its default (or that it is required), those with a value by
    argparse's own %(default)s, so the text cannot drift from the code."""
    parser = plan_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert "default" in action.help or action.required, action.option_strings
        if action.default not in (None, False):
            assert "%(default)s" in action.help, action.option_strings
    text = " ".join(parser.format_help().split())
    for shown in ("(default: 0.1)", "(default: 200.0)", "(default: 25.0)", "(default: 400.0)", "(default: 0.4)"):
        assert shown in text


def test_a_layout_fits_only_within_the_memory_headroom():
    """A layout fits when its peak is within the device's memory less the headroom: 10% unless set, as a share or a
    size (`--memory-headroom`); one whose peak is 95% of the device does not fit by default, and does with none."""
    prof, spec, work = profile(reference_gpt_on_meta(), 64), MeshSpec((4, 1), ("fsdp", "tp")), Workload(64, 4)
    peak = estimate(prof, spec, work, Hardware(1, 4, 1e12)).peak
    tight = Hardware(1, 4, peak / 0.95)
    assert tight.memory_headroom == 0.1 and not estimate(prof, spec, work, tight).fits
    assert estimate(prof, spec, work, replace(tight, memory_headroom=0.0)).fits
    assert memory_headroom("0.1", 80e9) == memory_headroom("10%", 80e9) == memory_headroom("8GB", 80e9) == 0.1
    for wrong in ("1", "90GB"):
        with pytest.raises(ConfigError, match=rf"--memory-headroom {wrong}: .* Fix: a share from 0 to below 1"):
            memory_headroom(wrong, 80e9)


def test_every_layout_is_planned_at_the_same_global_batch():
    """With a global batch, each layout takes it whole: micro-batch x accumulation x its data-parallel ranks, so step
    times compare (tokens per step the same on every row); tp=4 takes all 16 samples on one data-parallel rank, fsdp=4
    four per rank. A layout whose data-parallel ranks do not divide the global batch (fsdp=4 for 2 samples) is not
    tried."""
    model, hw = reference_gpt_on_meta(), Hardware(1, 4, 80e9)
    work = Workload(64, 4, global_batch=16)
    estimates, best, _ = recommend(model, work, hw, search=workloads(work))
    by_mesh = {(e.mesh, e.schedule): e for e in estimates}
    assert best is not None and len(by_mesh) > 4
    for e in estimates:
        assert e.micro_batch * e.accumulate * e.data_parallel == e.global_batch == 16, e
        assert e.tokens_per_s * e.step_s == pytest.approx(16 * 64)
    tp4, fsdp4 = by_mesh[('[[1, 4], ["fsdp", "tp"]]', None)], by_mesh[('[[4, 1], ["fsdp", "tp"]]', None)]
    assert tp4.micro_batch * tp4.accumulate == 16 and fsdp4.micro_batch * fsdp4.accumulate == 4
    two = replace(work, global_batch=2)
    assert {MeshSpec.parse(e.mesh).dp_size for e in recommend(model, two, hw, search=workloads(two))[0]} == {1, 2}


def test_an_auto_mesh_that_fits_only_checkpointed_names_the_setting():
    """`mesh_shape: auto` plans the run's own checkpointing and batch (`recommend` without a search); where none of its
    layouts fits so, the reason names the settings of the best layout that `plan`'s search (`workloads`) finds,
    as the overrides that make it fit: the reference GPT on 4 devices of 1.5 MB fits only with every block
    checkpointed. (`check --dry-run` of this case: test_check.py.)"""
    model, work, hw = reference_gpt_on_meta(), Workload(64, 4), Hardware(1, 4, 1.5e6)
    _, best, reason = recommend(model, work, hw, pipeline=False)
    assert best is None and reason.startswith("no layout fits: the smallest per-device peak is 1.73 MB")
    _, searched, _ = recommend(model, work, hw, pipeline=False, search=workloads(work))
    assert searched is not None and searched.activation_checkpointing == "full"
    fix = (
        f"Fix: --trainer.strategy.activation_checkpointing=full --data.init_args.batch_size={searched.micro_batch} "
        f"--trainer.accumulate_grad_batches={searched.accumulate} (it fits: {searched.mesh}"
    )
    assert fix in reason


def test_the_ep_refusal_suggests_a_mesh_that_keeps_ep():
    """ep=3 does not divide 8 experts: the fix keeps expert parallelism with the ep nearest below that divides them
    (2, the rest fsdp), not ep=1; ep=6 gives ep=2 on the same ranks."""
    with meta_parameters():
        moe = GPT(n_layer=1, n_head=4, n_embd=32, n_expert=8)
    with pytest.raises(PlanError, match=r"ep=3, which does not divide the 8 experts") as refused:
        resolve(moe, ep=3)
    assert str(refused.value).endswith(
        'Fix: an ep that divides 8 (1, 2, 4, 8), giving the other ranks to fsdp, e.g. mesh_shape [[-1, 2], ["fsdp", '
        '"ep"]] (on a world that 2 divides, fsdp taking the rest).'
    )
    with pytest.raises(PlanError) as refused:
        resolve(moe, ep=6)
    assert 'e.g. mesh_shape [[-1, 2], ["fsdp", "ep"]] (fsdp takes the ranks ep=2 frees).' in str(refused.value)


def test_a_model_that_fits_nowhere_says_by_how_much(tmp_path):
    proc = parallelkit(
        "plan",
        "--config",
        str(REPO / "configs" / "gpt70b.yaml"),
        "--devices-per-node",
        "8",
        "--device-memory",
        "16GB",
        cwd=tmp_path,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    out = " ".join(proc.stdout.split())
    assert "no layout fits (activation checkpointing and micro-batch searched): the smallest per-device peak is" in out
    assert "activation_checkpointing=full, batch_size=1 x accumulate_grad_batches=64)" in out  # the least: 64 a rank
    assert "over the 14.40 GB usable of each 16.00 GB device (10% kept free)" in out


def test_a_lora_model_has_gradients_and_optimizer_state_for_its_adapters_only():
    """Rank-4 adapters on q and v of a 2 x 64 GPT, on [[4, 1]] and [[2, 2]]: the weights are the model's plus the
    adapters', gradients and AdamW's moments the adapters' alone (tp splits half of each adapter: B of a column-wise
    layer), and the reduce-scatter carries their gradients only."""
    torch.manual_seed(0)
    sizes = {"n_layer": 2, "n_head": 4, "n_embd": 64}
    with torch.device("meta"):
        full, lora = GPT(**sizes), GPT(**sizes, lora={"rank": 4, "targets": ["attn.q", "attn.v"]})
    work, hw = Workload(seq_len=32, micro_batch=2), Hardware(1, 4, 80e9)
    params = sum(p.numel() for p in full.parameters())
    adapter_a, adapter_b = 2 * 2 * 4 * 64, 2 * 2 * 64 * 4  # A (rank x in) and B (out x rank) of q and v, 2 blocks
    for fsdp, tp in ((4, 1), (2, 2)):
        mesh = MeshSpec((fsdp, tp), ("fsdp", "tp"))
        base, adapted = estimate(profile(full, 32), mesh, work, hw), estimate(profile(lora, 32), mesh, work, hw)
        trained = (adapter_a + adapter_b / tp) / fsdp  # B is split with its column-wise layer's output rows
        assert adapted.params == base.params + 4 * trained
        assert adapted.grads == 4 * trained and adapted.optimizer == 8 * trained
        assert base.grads == base.params and params > 20 * (adapter_a + adapter_b)


def test_adapters_on_experts_are_counted_as_experts_with_gradients_and_optimizer_state():
    """Rank-4 adapters on q and on the experts' stacked up and down projections of a 2 x 64 GPT with 4 experts, on
    [[2, 2], ["fsdp", "ep"]]: the weights are the model's plus the adapters' (each expert's pair with its expert,
    divided over ep, sharded over fsdp), gradients and AdamW's moments the adapters' alone."""
    sizes = {"n_layer": 2, "n_head": 4, "n_embd": 64, "n_expert": 4, "top_k": 2}
    lora = {"rank": 4, "targets": ["attn.q", "experts.up", "experts.down"]}
    with torch.device("meta"):
        full, adapted_model = GPT(**sizes), GPT(**sizes, lora=lora)
    adapters = sum(p.numel() for p in adapted_model.parameters() if p.requires_grad)
    expert_adapters = sum(p.numel() for n, p in adapted_model.named_parameters() if "experts" in n and p.requires_grad)
    assert expert_adapters == 2 * 4 * 4 * (64 + 256) * 2  # layers x experts x rank x (in + out) x (up, down)
    mesh, work, hw = MeshSpec((2, 2), ("fsdp", "ep")), Workload(seq_len=32, micro_batch=2), Hardware(1, 4, 80e9)
    base, adapted = (estimate(profile(m, 32), mesh, work, hw) for m in (full, adapted_model))
    assert adapted.params == base.params + 4 * adapters / 4
    assert adapted.grads == 4 * adapters / 4 and adapted.optimizer == 8 * adapters / 4


def test_an_nf4_expert_base_is_counted_at_its_stored_size_divided_with_its_experts():
    """The same adapters with `quantize_base: nf4` (QLoRA: q's weight and each expert's up and down projection in
    NF4), on [[2, 2], ["fsdp", "ep"]]: the weights are LoRA's less each quantized weight's fp32 bytes plus its stored
    ones (an expert's row: codes, scales, factors, mean), a quarter per rank; gradients and optimizer state as
    LoRA's."""
    from parallelkit.adapters.nf4 import expert_nf4_bytes
    from parallelkit.memory import nf4_bytes

    sizes = {"n_layer": 2, "n_head": 4, "n_embd": 64, "n_expert": 4, "top_k": 2}
    lora = {"rank": 4, "targets": ["attn.q", "experts.up", "experts.down"]}
    with torch.device("meta"):
        plain, quantized = GPT(**sizes, lora=lora), GPT(**sizes, lora={**lora, "quantize_base": "nf4"})
    mesh, work, hw = MeshSpec((2, 2), ("fsdp", "ep")), Workload(seq_len=32, micro_batch=2), Hardware(1, 4, 80e9)
    a, b = (estimate(profile(m, 32), mesh, work, hw) for m in (plain, quantized))
    experts, expert = 2 * 2 * 4, 64 * 256  # layers x (up, down) x experts; values an expert
    saved = experts * (4 * expert - expert_nf4_bytes(expert)) + 2 * (4 * 64 * 64 - nf4_bytes(64 * 64))
    assert a.params - b.params == pytest.approx(saved / 4)
    assert a.grads == b.grads and a.optimizer == b.optimizer
    assert expert_nf4_bytes(expert) / expert < 0.53


def test_a_cp_axis_divides_activations_and_shards_and_adds_its_attention_traffic():
    """[[2, 2], ["fsdp", "cp"]] against [[2, 1]] (fsdp alone): parameters, gradients and optimizer state sharded four
    ways, as [[4, 1]] shards them; each rank's activations and compute halved (its half of every sequence); the cp
    axis's traffic the keys and values the all-gather method gathers (or Ulysses' all-to-alls), forward and
    backward. The profile's keys and values are the GPT's: 2 x seq x n_embd floats a block."""
    seq, work, hw = 64, Workload(seq_len=64, micro_batch=4), Hardware(1, 4, 80e9)
    prof = profile(reference_gpt_on_meta(), seq_len=seq)
    blocks = [layer for layer in prof.layers if layer.attention_kv]
    assert [layer.name for layer in blocks] == ["blocks.0", "blocks.1"]
    assert all(layer.attention_kv == 2 * seq * 64 * 4 and layer.attention_q == seq * 64 * 4 for layer in blocks)
    fsdp2, fsdp4 = (estimate(prof, MeshSpec((n, 1), ("fsdp", "tp")), work, hw) for n in (2, 4))
    cp = estimate(prof, MeshSpec((2, 2), ("fsdp", "cp")), work, hw)
    assert (cp.params, cp.grads, cp.optimizer) == (fsdp4.params, fsdp4.grads, fsdp4.optimizer)
    assert cp.activations == pytest.approx(fsdp2.activations / 2)
    kv = sum(layer.attention_kv for layer in blocks)
    assert cp.comm["cp"] == 2 * kv * (1 / 2) * work.micro_batch  # each rank receives the other half, and sends back
    q = sum(layer.attention_q for layer in blocks)
    ulysses = estimate(prof, MeshSpec((2, 2), ("fsdp", "cp")), replace(work, cp_method="ulysses"), hw)
    assert ulysses.comm["cp"] == 2 * (2 * q + kv) / 2 * (1 / 2) * work.micro_batch


def test_for_a_long_sequence_the_planner_tries_cp_layouts_and_picks_one_when_nothing_else_fits():
    """A GPT (8 x 1024, 16 heads) on one node of 8 devices: at 65,536 tokens, on 80 GB fsdp alone fits and is
    fastest (cp only adds traffic); on 8 GB only cp layouts fit, and the recommendation is one. Below
    LONG_SEQUENCE no cp layout is tried; Ulysses' layouts need the heads per tp rank divisible by cp."""
    with meta_parameters():
        gpt = GPT(n_layer=8, n_head=16, n_embd=1024)
    long, node = Workload(seq_len=65536, micro_batch=1), Hardware(1, 8, 80e9)
    estimates, best, _ = recommend(gpt, long, node, pipeline=False)
    assert best.mesh == '[[8, 1], ["fsdp", "tp"]]' and any('"cp"' in e.mesh for e in estimates)
    estimates, best, _ = recommend(gpt, long, replace(node, device_memory=8e9), pipeline=False)
    assert best.mesh == '[[1, 8, 1], ["fsdp", "cp", "tp"]]'
    assert all('"cp"' in e.mesh for e in estimates if e.fits) and not all(e.fits for e in estimates)
    short = recommend(gpt, replace(long, seq_len=4096), node, pipeline=False)[0]
    assert not any('"cp"' in e.mesh for e in short)
    with meta_parameters():
        six_heads = GPT(n_layer=2, n_head=6, n_embd=384)
    ulysses = recommend(six_heads, replace(long, cp_method="ulysses"), node, pipeline=False)[0]
    assert {e.mesh for e in ulysses if '"cp"' in e.mesh} == {'[[4, 2, 1], ["fsdp", "cp", "tp"]]'}  # 6 heads / cp


def test_muon_keeps_one_state_per_matrix_element_and_adds_its_exchange_to_the_traffic():
    """`--optimizer muon` on [[4], ["fsdp"]]: the optimizer state is one fp32 buffer per element of the matrices Muon
    takes (`hidden_matrices`) and AdamW's two for the rest, each rank a quarter; the traffic gains each rank's shard
    of the matrices sent in fp32 and received in bf16, twice (its own, and the owner's share)."""
    from parallelkit.optimizers.muon import hidden_matrices

    model = reference_gpt_on_meta()
    matrices = sum(model.get_parameter(name).numel() for name in hidden_matrices(model))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    prof, mesh, hw = profile(model, 32), MeshSpec((4,), ("fsdp",)), Hardware(1, 4, 80e9)
    adamw, muon = (estimate(prof, mesh, Workload(32, 2, optimizer=kind), hw) for kind in ("adamw", "muon"))
    assert adamw.optimizer == pytest.approx(8 * trainable / 4)
    assert muon.optimizer == pytest.approx((4 * matrices + 8 * (trainable - matrices)) / 4)
    assert muon.params == adamw.params and muon.grads == adamw.grads
    assert muon.comm["fsdp"] - adamw.comm["fsdp"] == pytest.approx(2 * 6 * matrices / 4)
    assert 0.5 < matrices / trainable < 1  # the blocks' linear layers, not the embedding and head


def test_preference_tunings_reference_is_counted_a_frozen_copy_as_parameters_and_adapters_off_as_nothing():
    """DPO on a Llama of configs/dpo.yaml's sizes, [[2, 2]]: a frozen copy adds the model's parameter shards and
    nothing else (no gradients, no optimizer state); with LoRA the reference is the base with its adapters off, no
    memory at all; either reference runs one more forward (a third of the step's compute). Pipeline layouts are
    planned for every reference (a frozen copy split into the model's stages)."""
    from parallelkit.models import HFCausalLM
    from parallelkit.models.preference import Preference

    sizes = {
        "model_type": "llama",
        "vocab_size": 264,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    lora = {"rank": 8, "targets": ["q_proj", "v_proj"]}
    with torch.device("meta"):
        models = {
            "sft": HFCausalLM(config=sizes),
            "copy": HFCausalLM(config=sizes, preference=Preference()),
            "lora": HFCausalLM(config=sizes, lora=lora),
            "adapters": HFCausalLM(config=sizes, lora=lora, preference=Preference()),
        }
    mesh, work, hw = MeshSpec((2, 2), ("fsdp", "tp")), Workload(seq_len=64, micro_batch=4), Hardware(1, 4, 80e9)
    plans = {name: estimate(profile(model, 64), mesh, work, hw) for name, model in models.items()}
    assert plans["copy"].params == 2 * plans["sft"].params
    assert (plans["copy"].grads, plans["copy"].optimizer) == (plans["sft"].grads, plans["sft"].optimizer)
    assert plans["adapters"].state == plans["lora"].state
    for dpo, sft in (("copy", "sft"), ("adapters", "lora")):
        assert plans[dpo].step_s > plans[sft].step_s
    pipelined = {
        name: {spec.size("pp") for spec, _ in candidates(profile(models[name], 64), hw, work)} for name in plans
    }
    assert pipelined["sft"] == pipelined["adapters"] == pipelined["copy"] > {1}
    staged = MeshSpec((2, 2), ("pp", "fsdp"))  # each stage's copy: that stage's parameters once more
    staged_plans = {
        name: estimate_layout(models[name], profile(models[name], 64), staged, "1f1b", work, hw)
        for name in ("copy", "sft")
    }
    assert staged_plans["copy"].params == 2 * staged_plans["sft"].params
