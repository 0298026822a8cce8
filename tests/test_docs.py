"""The README and the documentation site (docs/, mkdocs.yml): short, built with `--strict`, every fenced block run
or parsed by a test or marked illustrative, every test they name a test that exists."""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from snippets import PAGES, REPO, Block, blocks, commands, snippet
from support import assert_ok, import_dotted, launch, parallelkit

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
    """Broken links, pages left out of the navigation and API references that resolve to nothing fail the build. In
    the built pages: commands carry their language (the class stylesheets/code.css wraps them by), and the API
    reference calls no `**kwargs` or `*args` "required" (mkdocstrings' table style did, for arguments documented on a
    class that inherits its constructor)."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    guide = (tmp_path / "site" / "guides" / "lora-qlora" / "index.html").read_text()
    assert 'href="../../stylesheets/code.css"' in guide and 'class="language-bash highlight"' in guide
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    items = re.findall(r'<(li|tr) class="doc-section-item[^"]*">(.*?)</\1>', api, re.S)
    variadic = [text for _, text in items if re.search(r"<code>\*{1,2}\w+</code>", text)]
    assert len(variadic) >= 3, "the API page documents no **kwargs: the item finder finds nothing"
    required = [re.sub(r"<[^>]+>|\s+", " ", text).strip() for text in variadic if "required" in text]
    assert not required, f"variadic arguments shown as required in the API reference: {required}"
    assert 'id="parallelkit.adapters.lora.add_adapters"' in api


def test_the_built_site_is_not_committed():
    """`mkdocs build` writes `site/` at the repository root."""
    proc = subprocess.run(["git", "check-ignore", "-q", "site/index.html"], cwd=REPO, timeout=60)
    assert proc.returncode == 0, "site/ is not in .gitignore"


def fenced_lines(page: Path) -> list[tuple[int, str, bool]]:
    """(line number from 1, line, inside a fenced block) for each line of `page`, fences counted as inside."""
    found, inside = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```", line)
        found.append((number, line, inside or bool(fence)))
        if fence:
            inside = not inside
    return found


COMMAND_LANGS = {"bash", "console", "sh", "shell"}
COMMAND_WIDTH = 100


def test_every_command_line_of_the_site_fits_in_100_characters():
    """The theme shows about 78 characters of code beside both sidebars and wraps longer command lines
    (stylesheets/code.css); a command past 100 characters wraps twice or more, or was a scrollbar before the wrap.
    Break it with `\\` (tests/snippets.py joins continuation lines) or put its comment on a line of its own."""
    long = [
        f"{block.where}+{number}: {len(line)} characters"
        for block in blocks(tuple(page for page in PAGES if page.is_relative_to(REPO / "docs")))
        if block.lang in COMMAND_LANGS
        for number, line in enumerate(block.text.splitlines(), 1)
        if len(line) > COMMAND_WIDTH
    ]
    assert not long, f"command lines over {COMMAND_WIDTH} characters: {long}"


def test_the_sites_commands_wrap_and_stay_clear_of_the_copy_button():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    sheets = [REPO / config["docs_dir"] / sheet for sheet in config.get("extra_css", [])]
    css = "".join(sheet.read_text() for sheet in sheets if sheet.exists())
    wraps = re.search(r"\.language-bash pre > code[^{]*\{[^}]*white-space:\s*pre-wrap", css)
    assert wraps, f"no stylesheet of mkdocs.yml's extra_css ({sheets}) wraps bash blocks"
    assert re.search(r"pre > code\s*\{[^}]*padding-right", css), "code runs under the copy button"
    (highlight,) = [ext for ext in config["markdown_extensions"] if "pymdownx.highlight" in str(ext)]
    assert highlight["pymdownx.highlight"]["pygments_lang_class"], "blocks carry no language-bash class to wrap by"


def sections(page: Path) -> list[tuple[str, str]]:
    """The page's `## ` sections as (heading, text), the text before the first one under the heading ""."""
    found = [("", [])]
    for _, line, fenced in fenced_lines(page):
        if not fenced and line.startswith("## "):
            found.append((line[3:].strip(), []))
        else:
            found[-1][1].append(line)
    return [(heading, "\n".join(lines)) for heading, lines in found]


GUIDES = sorted((REPO / "docs" / "guides").glob("*.md"))


@pytest.mark.parametrize("page", GUIDES, ids=lambda page: page.stem)
def test_each_guide_opens_with_its_task_and_ends_with_the_tests_that_pin_it(page):
    """A reader who came to do something meets the command first; the tests that pin a guide are listed
    in its last section, `## Pinned by` (a note under a command may name the test that runs it)."""
    *body, (last, pinned) = sections(page)
    assert last == "Pinned by", f"{page.name}: its last section is {last!r}, not '## Pinned by'"
    assert named_tests(pinned), f"{page.name}: its Pinned by section names no test"
    lines = fenced_lines(page)
    first_block = next((number for number, _, fenced in lines if fenced), None)
    before = "\n".join(line for number, line, _ in lines if first_block is None or number < first_block)
    if first_block is None:  # no command: the whole page before its Pinned by section
        before = "\n".join(text for _, text in body)
    assert not named_tests(before), f"{page.name}: names tests before its first code block: {named_tests(before)}"
    paragraphs = [p for _, text in body for p in re.split(r"\n\s*\n", text) if re.search(r"(?i)\bpinned by\b", p)]
    assert not paragraphs, f"{page.name}: 'Pinned by' paragraphs outside its last section: {paragraphs}"


PYPROJECT = (REPO / "pyproject.toml").read_text()
ENTRY_POINT_GROUPS = set(re.findall(r'^\[project\.entry-points\."([\w.]+)"\]', PYPROJECT, re.M))
NOT_IN_THE_API = {
    "parallelkit.optimizers.compiled.replicate_plain_tensors": (
        "performance.md says how the optimizer step treats plain tensors"
    ),
}
"""Functions and classes the pages may name without the API reference documenting them, with the reason."""


def test_every_class_and_function_the_pages_name_is_in_the_api_reference():
    """A dotted `parallelkit.x.y` a page names is an importable name (or an entry-point group), and when it is a
    class or a function the API reference (docs/reference/api.md) documents it, under that path or another."""
    reference = REPO / "docs" / "reference" / "api.md"
    documented = [import_dotted(name) for name in re.findall(r"^::: (\S+)", reference.read_text(), re.M)]
    unknown, missing = [], []
    for page in PAGES:
        if page == reference:
            continue
        for name in sorted(set(re.findall(r"\bparallelkit(?:\.[A-Za-z_]\w*)+", page.read_text()))):
            if name in ENTRY_POINT_GROUPS or name in NOT_IN_THE_API:
                continue
            try:
                found = import_dotted(name)
            except (ImportError, AttributeError):
                unknown.append(f"{page.relative_to(REPO)}: {name}")
                continue
            if (inspect.isclass(found) or inspect.isfunction(found)) and not any(found is d for d in documented):
                missing.append(f"{page.relative_to(REPO)}: {name}")
    assert not unknown, f"names that import nothing: {unknown}"
    assert not missing, f"classes and functions the pages name that the API reference leaves out: {missing}"


def test_the_precision_section_lists_every_precision_and_the_tests_that_check_it():
    """Every parity claim is fp32; the Precision section says, per precision a parallelkit strategy runs, what it is
    checked against, and names every test that trains or validates in bf16."""
    from parallelkit.strategies.precision import PRECISIONS

    page = REPO / "docs" / "guides" / "your-model.md"
    (section,) = [text for heading, text in sections(page) if heading == "Precision"]
    rows = re.findall(r"^\| `([\w-]+)` \|", section, re.M)
    assert rows[: len(PRECISIONS)] == list(PRECISIONS), f"the table's precisions {rows} are not {list(PRECISIONS)}"
    named = {ref.split("::")[1] for ref in named_tests(page.read_text())}
    bf16 = {
        name for names in defined_tests().values() for name in names if re.match(r"test_\w*bf16_(mixed|true)", name)
    }
    assert bf16 and not bf16 - named, f"bf16 tests your-model.md's Precision section does not name: {bf16 - named}"
    assert "docs/guides/your-model.md#precision" in (REPO / "README.md").read_text()
