"""The Hugging Face family sweep: every causal-LM family the installed transformers registers, made tiny from its
config class, checked against transformers' own forward on one process (no launches).

`python tests/hf_families.py --write` runs the sweep and writes what it found where the product reads it: the
families whose pipeline stages equal the model's own forward (`parallelkit/models/hf_families.py`) and
docs/families.md's table. `tests/test_hf_families.py` runs the same sweep and fails when either differs from what
it finds.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
FAMILIES_MODULE = REPO / "src" / "parallelkit" / "models" / "hf_families.py"
FAMILIES_PAGE = REPO / "docs" / "families.md"
TABLE_START, TABLE_END = "<!-- hf-families:start -->", "<!-- hf-families:end -->"

SIZES = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim"), 64),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "decoder_ffn_dim", "encoder_ffn_dim"), 128),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "decoder_layers", "encoder_layers", "n_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "decoder_attention_heads"), 4),
    "encoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    **dict.fromkeys(("max_position_embeddings", "n_positions"), 256),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4),
    "num_experts_per_tok": 2,
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), 32),
    "sliding_window": 8,  # shorter than the sweep's sequences: windows are exercised
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "n_group": 1,
    "topk_group": 1,
    # State-space (Mamba-2) layers: their chunked scan pads a sequence to a whole chunk (falcon_h1: 256 tokens).
    **dict.fromkeys(("mamba_d_ssm", "mamba_n_heads", "mamba_num_heads"), 8),
    **dict.fromkeys(("mamba_d_state", "ssm_state_size", "mamba_chunk_size", "chunk_size"), 16),
    "mamba_head_dim": 8,
}
"""Size fields made small wherever a config class has them (as an int, or `head_dim`/`sliding_window` as None)."""

MAX_PARAMETERS = 3_000_000
"""A family whose tiny config still has more parameters has size fields the sweep does not know: not checked."""

SEQ = 16
TOLERANCE = 1e-6


@dataclass
class Row:
    family: str
    exact: str = ""  # "yes" or why the family is not checked / refused
    tp: str = ""
    pp: str = ""
    cp: str = ""
    error: str = ""  # a failure of parallelkit's own (the sweep test fails on it)


def tiny_config(model_type: str) -> dict:
    """The family's config with every size field the sweep knows made small, dropout off, token ids inside the
    vocabulary and untied embeddings (so pipelines can be checked)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    params = inspect.signature(cls.__init__).parameters
    default = cls()
    fields = default.to_dict()
    options: dict = {"model_type": model_type}
    for key, size in SIZES.items():
        value = getattr(default, key, None)
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            or (key in params and value is None and key in ("head_dim", "sliding_window"))
        ):
            options[key] = size
    for key, value in fields.items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            options[key] = 0.0
        if key.endswith("token_id") and isinstance(value, int) and not 0 <= value < 256:
            options[key] = 1
    if "tie_word_embeddings" in fields or "tie_word_embeddings" in params:
        options["tie_word_embeddings"] = False
    if "is_decoder" in fields:  # BERT-like families attend both ways unless told they are decoders
        options["is_decoder"] = True
    return options


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300] or type(err).__name__


def _reference(options: dict):  # noqa: ANN202
    """transformers' own model for the config (None, reason when it cannot be built small or run)."""
    import transformers

    config = transformers.AutoConfig.for_model(**options)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in meta.parameters())
    if count > MAX_PARAMETERS:
        return None, f"not checked: the sweep's tiny config still has {count / 1e6:.0f}M parameters"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    tokens = torch.randint(0, 256, (2, SEQ + 1))
    with torch.no_grad():
        out = model(input_ids=tokens, labels=tokens)
    if out.loss is None or not torch.isfinite(out.loss):
        return None, "not checked: transformers' own forward gives no finite loss on the sweep's tiny config"
    return (model, tokens, out.loss), ""


def check_family(model_type: str) -> Row:
    """One family: logits and loss against transformers' own forward (same weights), whether its tp plan
    translates, and whether two pipeline stages, each holding only its layers, compute the model's own logits."""
    from parallelkit.errors import ConfigError, PlanError
    from parallelkit.models import HFCausalLM
    from parallelkit.parallel import resolve

    row = Row(model_type)
    try:
        options = tiny_config(model_type)
        reference, reason = _reference(options)
    except Exception as err:  # noqa: BLE001 - transformers' own failures: the family is not covered
        row.exact = f"not checked: transformers' own model fails on a tiny config ({type(err).__name__})"
        return row
    if reference is None:
        row.exact = reason
        return row
    expected, tokens, expected_loss = reference
    try:
        model = HFCausalLM(options).eval()
        if wrong := _initialised_unlike(model, expected):
            row.error = f"{model_type}: HFCausalLM's initialisation from the seed: {wrong}"
            return row
        model.model.load_state_dict(expected.state_dict())
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        with torch.no_grad():
            logits = model(inputs)
            loss = model.pipeline_loss(logits, targets)
            torch.testing.assert_close(logits, expected(input_ids=inputs).logits, rtol=TOLERANCE, atol=TOLERANCE)
            if not torch.allclose(loss, expected_loss, rtol=TOLERANCE, atol=TOLERANCE):
                # Some families take labels already shifted (the targets themselves): their loss on (inputs, targets).
                expected_loss = expected(input_ids=inputs, labels=targets).loss
            torch.testing.assert_close(loss, expected_loss, rtol=TOLERANCE, atol=TOLERANCE)
    except (ConfigError, PlanError) as err:
        row.exact = f"refused: {_one_line(err)}"
        return row
    except Exception as err:  # noqa: BLE001 - parallelkit's own failure: the sweep test names it
        row.error = f"{model_type}: {type(err).__name__}: {_one_line(err)}"
        return row
    try:
        resolve(model)
    except PlanError as err:  # no decoder layers to shard: refused under every parallel strategy
        row.exact = f"refused: {_one_line(err)}"
        return row
    row.exact = "yes"
    try:
        row.tp = _tp(model)
        row.pp = _pp(model, tokens[:, :-1])
        row.cp = _cp(model, tokens[:, :-1])
    except Exception as err:  # noqa: BLE001 - reading the plan must refuse by name, never fail like this
        row.error = f"{model_type}: reading its plan: {type(err).__name__}: {_one_line(err)}"
    return row


def _initialised_unlike(model, expected) -> str:  # noqa: ANN001
    """What HFCausalLM's own initialisation gets wrong against transformers' eager build (random draws aside): a
    parameter not finite, or one transformers sets to a constant (norms, biases, an activation's scalars) holding
    another value. "" when none."""
    theirs = dict(expected.named_parameters())
    for name, param in model.model.named_parameters():
        reference = theirs[name]
        if not torch.isfinite(param).all():
            return f"{name} is not finite"
        constant = reference.numel() > 0 and bool(reference.min() == reference.max())
        if constant and not torch.equal(param, reference):
            return f"{name} is {param.flatten()[:3].tolist()}..., transformers sets {reference.flatten()[0].item()}"
    return ""


def _tp(model) -> str:  # noqa: ANN001
    from parallelkit.errors import PlanError
    from parallelkit.parallel import resolve

    try:
        resolve(model, tp=2)
    except PlanError as err:
        text = str(err)
        if "family sweep" in text:  # not in TP_FAMILIES: what the launch on two processes decides
            return "yes"
        if "declares no tensor-parallel plan" in text:
            return "no tp plan declared"
        if "splits only its experts" in text:
            return "tp plan splits only experts (use ep)"
        style = re.search(r"the style '(\w+)'", text)
        return f"style {style.group(1)} not translated" if style else _one_line(err)
    return "yes"


def _pp(model, tokens: torch.Tensor) -> str:  # noqa: ANN001
    """ "yes" when two stages compute the model's own logits (to 1e-6), else why not."""
    from dataclasses import replace

    from parallelkit.compat import hf_pp_plan
    from parallelkit.contract import declared_plan
    from parallelkit.errors import PlanError
    from parallelkit.parallel import resolve
    from parallelkit.parallel.pipeline import StageModule, drop_layers

    if not hf_pp_plan(model.model):
        return "no pipeline plan declared"
    refusal = declared_plan(model).pipeline_refusal
    if refusal and "family sweep" not in refusal:  # refused for what the model declares, before any check
        return "its pipeline plan names a module it lacks" if "does not have" in refusal else refusal
    contract = replace(declared_plan(model), pipeline_refusal="")  # the allowlist is what this check decides
    try:
        resolved = resolve(model, num_stages=2, plan=contract)
    except PlanError as err:
        return "parameters outside its pipeline plan" if "outside pipeline_layers" in str(err) else _one_line(err)
    layers = resolved.pipeline_layers
    stages = []
    for held in resolved.stages:
        stage = copy.deepcopy(model)
        drop_layers(stage, [name for name in layers if name not in held])
        stages.append(StageModule(stage, held, replace(declared_plan(stage), pipeline_refusal="")))
    try:
        with torch.no_grad():
            torch.testing.assert_close(stages[1](*stages[0](tokens)), model(tokens), rtol=TOLERANCE, atol=TOLERANCE)
    except AssertionError:
        return "stages differ from its own forward"
    except Exception as err:  # noqa: BLE001 - a stage that cannot run as the model does is not pipelined
        return f"stages fail ({type(err).__name__})"
    return "yes"


def _cp(model, tokens: torch.Tensor) -> str:  # noqa: ANN001
    """ "yes" when the model, its attention routed to parallelkit's split attention (`hf_attention`) and one process
    holding both cp ranks' slices of each row (cp = 2, tokens in the ranks' order, each with its global position),
    computes its own logits at every token (to 1e-6): for unpacked rows and for rows of two packed examples. Else
    why not. What this finds out per family is what the split needs of a model: attention only through transformers'
    attention interface, positions read from `position_ids`, nothing else mixing tokens."""
    from parallelkit.contract import declared_plan
    from parallelkit.errors import PlanError
    from parallelkit.parallel.context_parallel import SequenceSplit, allgather_attention, route_attention
    from parallelkit.parallel.resolve import select

    plan = declared_plan(model)
    if plan.attention_refusal and "family sweep" not in plan.attention_refusal:
        return plan.attention_refusal.split(". Fix")[0]
    if not plan.attention:
        return "no attention modules found in its decoder layers"
    split = SequenceSplit(2, 0)
    order = split.gathered(tokens.shape[1])
    split_model = copy.deepcopy(model)
    unpacked = torch.arange(tokens.shape[1]).expand_as(tokens)
    packed = torch.cat((torch.arange(6), torch.arange(tokens.shape[1] - 6))).expand_as(tokens)
    try:
        attention = [name for name, _ in select(split_model, plan.attention, "attention")]
        route_attention(split_model, attention, functools.partial(allgather_attention, group=None, split=split))
        with torch.no_grad():
            for kind, positions in (("unpacked", unpacked), ("packed", packed)):
                expected = model(tokens, position_ids=positions)[:, order]
                actual = split_model(tokens[:, order], position_ids=positions[:, order])
                if not torch.allclose(actual, expected, rtol=TOLERANCE, atol=TOLERANCE):
                    return f"split rows differ from its own forward ({kind})"
    except PlanError as err:
        return _one_line(err).split(". Fix")[0]
    except Exception as err:  # noqa: BLE001 - a model that cannot run split is not split
        return f"split rows fail ({type(err).__name__})"
    return "yes"


def tp_on_two_processes(families: list[str], out: Path) -> dict[str, str]:
    """`{family: "" | what differs}`: each family split tp=2 with sequence parallelism on two gloo processes
    (`tests/scripts/hf_tp_families.py`, one launch) against one process's loss and gradients."""
    import json

    from support import assert_ok, torchrun

    assert_ok(torchrun("hf_tp_families.py", 2, str(out), *families, cwd=out.parent))
    return json.loads(out.read_text())


def with_tp_checked(rows: list[Row], out: Path) -> list[Row]:
    """`rows` with tp "yes" only where two processes give one process's loss and gradients."""
    results = tp_on_two_processes([row.family for row in rows if row.tp == "yes"], out)
    for row in rows:
        if row.tp == "yes" and results[row.family]:
            row.tp = "differs on 2 processes"
    return rows


def sweep(names: list[str] | None = None) -> list[Row]:
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    return [check_family(name) for name in (names or families())]


def render_families_module(rows: list[Row]) -> str:
    import transformers

    pipelined = ",\n".join(f'    "{row.family}"' for row in rows if row.pp == "yes")
    split = ",\n".join(f'    "{row.family}"' for row in rows if row.tp == "yes")
    cp = ",\n".join(f'    "{row.family}"' for row in rows if row.cp == "yes")
    version = transformers.__version__
    return (
        f'"""Generated by `python tests/hf_families.py --write` (transformers {version}); do not edit.\n\n'
        "What the family sweep (`tests/test_hf_families.py`) found: `HFCausalLM` runs pipelines, tensor and context\n"
        'parallelism for these families and refuses the others."""\n\n'
        f'GENERATED_WITH = "{version}"\n'
        '"""The transformers version the sweep ran on (docs/families.md says what it found there)."""\n\n'
        f"PIPELINE_FAMILIES = (\n{pipelined},\n)\n\n"
        '"""Families whose two pipeline stages compute the model\'s own logits."""\n\n'
        f"TP_FAMILIES = (\n{split},\n)\n"
        '"""Families that, split tp=2 with sequence parallelism on two processes, give one process\'s loss and\n'
        'gradients."""\n\n'
        f"CP_FAMILIES = (\n{cp},\n)\n"
        '"""Families whose sequences, split over cp ranks (one process holding every rank\'s slice), give the model\'s '
        'own\nlogits, packed examples included."""\n'
    )


def render_table(rows: list[Row]) -> str:
    import transformers

    exact = [row for row in rows if row.exact == "yes"]
    other = [row for row in rows if row.exact != "yes"]
    lines = [
        TABLE_START,
        "Generated by `python tests/hf_families.py --write` from the family sweep (transformers"
        f" {transformers.__version__},"
        f" {len(rows)} causal-LM families; `tests/test_hf_families.py` fails when this differs). **{len(exact)}** give"
        " transformers' own logits and loss on one process (1e-6, same weights); each trains under fsdp. tp: split"
        " tp=2 with sequence parallelism on two processes, one step's loss and gradients equal one process's (1e-5);"
        " pp: two pipeline stages compute the model's own logits; cp: each row split over 2 cp ranks (one process"
        " holding both slices, unpacked and packed rows) gives the model's own logits. The rest is refused by name.",
        "",
        "| family | tp | pp | cp |",
        "|---|---|---|---|",
        *(f"| {row.family} | {row.tp} | {row.pp} | {row.cp} |" for row in exact),
        "",
        "<details><summary>Not covered: " + f"{len(other)} families</summary>",
        "",
        "| family | why |",
        "|---|---|",
        *(f"| {row.family} | {row.exact.replace('|', '/')} |" for row in other),
        "",
        "</details>",
        TABLE_END,
    ]
    return "\n".join(lines)


def page_with(table: str) -> str:
    text = FAMILIES_PAGE.read_text()
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    return text[:start] + table + text[end:]


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def main() -> None:
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    rows = sweep(names or None)
    if "--write" in sys.argv or "--tp" in sys.argv:
        import tempfile

        rows = with_tp_checked(rows, Path(tempfile.mkdtemp()) / "tp.json")
    for row in rows:
        print(row, flush=True)
    if "--write" in sys.argv and not names:
        FAMILIES_MODULE.write_text(render_families_module(rows))
        FAMILIES_PAGE.write_text(page_with(render_table(rows)))


if __name__ == "__main__":
    main()
