"""The README and the documentation site (docs/, mkdocs.yml): short, built with `--strict`, every fenced block run
or parsed by a test or marked illustrative, every test they name a test that exists."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from snippets import PAGES, REPO, Block, blocks, commands, snippet
from support import assert_ok, launch, parallelkit

TEST_FILES = (*sorted((REPO / "tests").glob("*.py")), *sorted((REPO / "plugins").glob("*/tests/*.py")))
READS = re.compile(r"""\b(?:snippet|commands|parallelkit_args)\(\s*["']([\w.-]+)["']""")


def test_the_readme_is_a_front_door_of_at_most_250_lines():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_every_fenced_block_is_exercised_by_a_test_or_marked_illustrative_with_its_reason():
    found = blocks()
    assert len(found) > 20, "the block finder finds nothing"
    unmarked = [block.where for block in found if block.kind is None]
    assert not unmarked, f"blocks with neither <!-- snippet: NAME --> nor <!-- illustrative: why --> above: {unmarked}"
    bare = [block.where for block in found if not block.label]
    assert not bare, f"marks without a name or a reason: {bare}"
    named = [block.label for block in found if block.kind == "snippet"]
    assert len(named) == len(set(named)), (
        f"snippet names used twice: {sorted({n for n in named if named.count(n) > 1})}"
    )
    read = {name for path in TEST_FILES for name in READS.findall(path.read_text())}
    parsed_here = {block.label for block in yaml_blocks()}
    unread = [block.where for block in found if block.kind == "snippet" and block.label not in read | parsed_here]
    assert not unread, f"snippets no test reads (run it, or mark it illustrative with the reason): {unread}"


def test_the_block_finder_reads_marks_indented_blocks_and_commands(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n<!-- snippet: one -->\n```bash\nparallelkit fit \\\n  --a=1  # why\nx && y\n```\n\n"
        "- item\n\n  <!-- illustrative: needs a cluster -->\n  ```bash\n  srun parallelkit fit\n  ```\n\n"
        "```\nbare\n```\n"
    )
    one, two, three = blocks((page,))
    assert (one.kind, one.label, one.lang, one.line) == ("snippet", "one", "bash", 4)
    assert (two.kind, two.label, two.text) == ("illustrative", "needs a cluster", "srun parallelkit fit\n")
    assert three.kind is None


def test_commands_join_continuations_drop_comments_and_split_at_and():
    text = snippet("two-commands").text
    assert "pip install" in text
    first, main, *_ = commands("two-commands")
    assert first[:2] == ["pip", "install"] and main == ["parallelkit", "fit", "--config", "configs/hybrid.yaml"]


def test_ci_runs_the_readmes_test_command_as_written():
    *_, install, pytest_ = commands("two-commands")
    assert pytest_ == ["pytest"] and install[:2] == ["pip", "install"]
    ci = (REPO / ".ci" / "run").read_text()
    assert f"{' '.join(install)} && pytest" in ci.replace('".[', ".[").replace(']"', "]")


def yaml_blocks() -> list[Block]:
    return [block for block in blocks() if block.lang == "yaml" and block.kind == "snippet"]


@pytest.mark.parametrize("block", yaml_blocks(), ids=lambda block: block.label)
def test_every_yaml_block_is_a_config_the_cli_reads(block, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(block.text)
    proc = parallelkit("fit", "--config", str(config), "--print_config", cwd=tmp_path)
    assert_ok(proc)
    assert "class_path" in proc.stdout


def test_the_python_api_block_builds_trainers_by_name_and_by_class():
    import parallelkit

    scope: dict = {}
    exec(snippet("python-api").text, scope)
    assert isinstance(scope["by_name"].strategy, parallelkit.FSDPTPStrategy)
    assert scope["by_class"].strategy.mesh_shape == [[2, 2], ["fsdp", "tp"]]


def test_the_hugging_face_python_block_trains_a_qwen3_in_1f1b_on_two_processes(tmp_path):
    """The guide's script as a user runs it (`python script.py`: Lightning's launcher starts the second rank), at 3
    steps instead of 20; the default data is the standard library's text."""
    text = snippet("hf-python").text
    assert "max_steps=20" in text
    script = tmp_path / "train.py"
    script.write_text(text.replace("max_steps=20", "max_steps=3, log_every_n_steps=1, enable_progress_bar=False"))
    assert_ok(launch([], cwd=tmp_path, script=str(script)).result(600))
    (metrics,) = tmp_path.glob("lightning_logs/version_0/metrics.csv")
    assert "train_loss" in metrics.read_text()


def test_the_model_contract_block_is_the_reference_gpts_declaration():
    import lightning as L

    from parallelkit.models import GPT

    scope = {"L": L}
    exec(snippet("model-contract").text, scope)
    for name in ("tp_plan", "fsdp_units", "pipeline_layers", "attention_plan"):
        assert getattr(scope["GPT"], name) == getattr(GPT, name), name


def test_the_plugin_guides_strategy_is_a_strategy_with_its_option():
    import parallelkit

    scope: dict = {}
    exec(snippet("plugin-strategy").text, scope)
    strategy = scope["FooStrategy"](mesh_shape=[[2], ["fsdp"]], my_option=3)
    assert isinstance(strategy, parallelkit.FSDPTPStrategy)
    assert (strategy.my_option, strategy.plugin_api) == (3, parallelkit.PLUGIN_API)


def named_tests(text: str) -> list[str]:
    """`test_x.py::test_name` references in `text`, with `::test_name` right after one taken as the same file's."""
    found, current = [], None
    for match in re.finditer(r"((?:[\w/.-]+/)?test_\w+\.py)?::(test_\w+)|((?:[\w/.-]+/)?test_\w+\.py)", text):
        path, name, alone = match.groups()
        current = path or alone or current
        if name and current:
            found.append(f"{current}::{name}")
    return found


def defined_tests() -> dict[str, set[str]]:
    tests: dict[str, set[str]] = {}
    for path in TEST_FILES:
        tree = ast.parse(path.read_text())
        names = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.ClassDef)}
        tests.setdefault(path.name, set()).update(names)
    return tests


def test_every_test_the_readme_and_docs_name_exists():
    tests = defined_tests()
    missing = []
    for page in PAGES:
        for ref in named_tests(page.read_text()):
            path, name = ref.split("::")
            if name not in tests.get(Path(path).name, set()):
                missing.append(f"{page.relative_to(REPO)}: {ref}")
    assert not missing, f"named tests that do not exist: {missing}"


def test_each_guide_names_the_tests_that_pin_what_it_shows():
    unpinned = [
        page.name for page in sorted((REPO / "docs" / "guides").glob("*.md")) if not named_tests(page.read_text())
    ]
    assert not unpinned, f"guides that name no test: {unpinned}"


def test_the_site_builds_with_strict_checks(tmp_path):
    """Broken links, pages left out of the navigation and API references that resolve to nothing fail the build."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert (tmp_path / "site" / "guides" / "lora-qlora" / "index.html").exists()
