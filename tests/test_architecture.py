"""The layout docs/architecture.md describes, held: who may import whom, where the plan is read, file sizes."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "parallelkit"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path) -> set[str]:
    """The parallelkit modules `path` imports: at the top, inside functions, and under `if TYPE_CHECKING:` (a circle
    of types is still a circle: the two modules are one room)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in MODULES)
    return found - {module_name(path)}


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph`: its strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while (member := stack.pop()) != node:
                group.append(member)
            if group:
                found.append(sorted([node, *group]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_finder_sees_a_cycle_through_an_import_inside_a_function_or_for_types_only():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    body = "def f():\n    from parallelkit.adapters.lora import LoRA\n"
    assert "parallelkit.adapters.lora" in imports_of_text(body)
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from parallelkit.mesh import MeshSpec\n"
    assert "parallelkit.mesh" in imports_of_text(typing_only)


def imports_of_text(text: str) -> set[str]:
    path = PACKAGE / "_probe_.py"
    try:
        path.write_text(text)
        return imports(path)
    finally:
        path.unlink()


def test_the_package_has_no_import_cycle():
    assert not cycles(GRAPH), cycles(GRAPH)


def test_the_contract_imports_nothing_of_ours_and_the_parallel_code_no_lora_or_strategy():
    assert GRAPH["parallelkit.contract"] == set()
    parallel = {name: deps for name, deps in GRAPH.items() if name.startswith("parallelkit.parallel")}
    assert parallel, "no parallel package"
    for name, deps in parallel.items():
        adapters = ("parallelkit.adapters.lora", "parallelkit.adapters.experts")  # NF4 storage is no adapter
        wrong = {d for d in deps if d.startswith((*adapters, "parallelkit.strategies", "parallelkit.models"))}
        assert not wrong, f"{name} imports {wrong}: a technique knows the contract, not models, LoRA or strategies"


@pytest.fixture(scope="module")
def fresh_imports() -> list[str]:
    """What a fresh interpreter prints as it imports (the question is what an import loads), line by line: after
    `import parallelkit.contract`, after `import parallelkit` and a use of a root name, after `parallelkit env`, and
    after importing one room of each of the adapters and optimizers packages."""
    import subprocess
    import sys

    from support import subprocess_env

    rooms = "sorted(m for m in sys.modules if m.startswith(('parallelkit.adapters.', 'parallelkit.optimizers.')))"
    code = (
        "import sys, parallelkit.contract\n"
        "heavy = ('lightning', 'pytorch_lightning', 'torchmetrics', 'parallelkit.strategies', 'parallelkit.cli')\n"
        "print(sorted(name for name in heavy if name in sys.modules))\n"
        "import parallelkit\n"
        "print(parallelkit.MeshSpec.__module__, 'lightning' in sys.modules)\n"
        "from parallelkit.cli import main\n"
        "try:\n"
        "    main(['env'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('lightning' in sys.modules)\n"
        f"print({rooms})\n"
        "import parallelkit.adapters.nf4, parallelkit.optimizers.grad_norm\n"
        f"print({rooms})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_importing_the_contract_loads_no_lightning_and_the_root_hands_its_names_on_when_used(fresh_imports):
    """`import parallelkit.contract` loads neither Lightning nor anything that imports it (torchmetrics), nor any
    strategy; the root's names come when asked for; `parallelkit env`, a tool that needs no Lightning, runs without
    loading it (the CLI imports a tool when run)."""
    lines = fresh_imports
    assert lines[:2] == ["[]", "parallelkit.mesh False"] and lines[-3] == "False", lines  # env: no Lightning


def calls(path: Path, function: str) -> int:
    """Calls of `function` by its plain name (as imported: `resolve(...)`, not `path.resolve()`)."""
    tree = ast.parse(path.read_text())
    return sum(isinstance(node, ast.Call) and getattr(node.func, "id", None) == function for node in ast.walk(tree))


def test_the_declared_plan_is_read_in_resolve_alone_and_at_build_time_by_lora():
    readers = {module_name(path) for path in MODULES.values() if calls(path, "declared_plan")}
    assert readers == {"parallelkit.parallel.resolve", "parallelkit.adapters.lora"}, readers
    resolvers = {module_name(path) for path in MODULES.values() if calls(path, "resolve")}
    # The strategies (once per process), the planner (once per model), the monitors under a strategy that resolves
    # none, and `parallelize` called outside a strategy.
    assert resolvers == {
        "parallelkit.strategies.base",
        "parallelkit.strategies.pipeline",
        "parallelkit.planner.profile",
        "parallelkit.callbacks.monitors",
        "parallelkit.callbacks.experts",
        "parallelkit.parallel",
    }, resolvers


def test_no_module_is_over_450_lines():
    """A room that grows past this holds more than one job: split it along them (docs/architecture.md)."""
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    crowded = {name: lines for name, lines in sizes.items() if lines > 450}
    assert not crowded, f"modules over 450 lines: {crowded}"


MOVED = {
    "parallelkit.lora": "parallelkit.adapters.lora",
    "parallelkit.lora_experts": "parallelkit.adapters.experts",
    "parallelkit.quantize": "parallelkit.adapters.nf4",
    "parallelkit.muon": "parallelkit.optimizers.muon",
    "parallelkit.optim": "parallelkit.optimizers.compiled",
    "parallelkit.grad_norm": "parallelkit.optimizers.grad_norm",
}


def test_the_rooms_that_moved_into_adapters_and_optimizers_keep_their_old_import_paths(fresh_imports):
    """An old path is the new module itself (the same object: what a user patched or imported from either is one
    thing), the packages' doors hand on their public names without loading the other rooms, and the old modules hold
    nothing of their own (no circle through them, no second copy of a name)."""
    import importlib

    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
        assert GRAPH[old] == {new, new.rpartition(".")[0]}, (old, GRAPH[old])
    import parallelkit
    from parallelkit import adapters, optimizers
    from parallelkit.lora import LoRA
    from parallelkit.muon import Muon

    assert adapters.LoRA is LoRA and optimizers.Muon is Muon is parallelkit.Muon
    # In a fresh interpreter (after the root, the CLI and `env`, which load none of them): one room each, alone.
    assert fresh_imports[-2:] == ["[]", "['parallelkit.adapters.nf4', 'parallelkit.optimizers.grad_norm']"], (
        fresh_imports
    )
