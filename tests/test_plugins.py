"""Entry-point plugins, tested the way pip installs them: a *.dist-info with entry_points.txt on sys.path."""

import sys
from pathlib import Path

import pytest
from support import assert_ok, parallelkit, run


def install_fake_distribution(site: Path, dist: str, module: str, source: str, entry_points: str) -> None:
    info = site / f"{dist.replace('-', '_')}-0.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(entry_points)
    (site / f"{module}.py").write_text(source)


GOOD = """
from lightning.pytorch.strategies import DDPStrategy

class GoodStrategy(DDPStrategy):
    '''DDP under another name, from a third party.'''
"""


FUTURE = """
from lightning.pytorch.strategies import DDPStrategy

class FutureStrategy(DDPStrategy):
    '''Written against a plugin API this parallelkit does not have yet.'''
    plugin_api = 99
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site directory as pip leaves it, with three third-party plugins: one broken at import, one good (whose
    second name clashes with Lightning's `ddp`), one written for a plugin API from the future; and a fourth as pip
    leaves it while it installs or uninstalls one, without METADATA."""
    site = tmp_path_factory.mktemp("plugins") / "site"
    install_fake_distribution(
        site,
        "parallelkit-broken",
        "pk_broken",
        "raise RuntimeError('boom at import')\n",
        "[parallelkit.strategies]\nbroken = pk_broken:Strategy\n",
    )
    install_fake_distribution(
        site,
        "parallelkit-good",
        "pk_good",
        GOOD,
        "[parallelkit.strategies]\ngood = pk_good:GoodStrategy\nddp = pk_good:GoodStrategy\n",
    )
    install_fake_distribution(
        site, "parallelkit-future", "pk_future", FUTURE, "[parallelkit.strategies]\nfuture = pk_future:FutureStrategy\n"
    )
    # One pip is installing or removing: its entry points there, its METADATA not (yet, or any more).
    install_fake_distribution(
        site, "parallelkit-half", "pk_half", GOOD, "[parallelkit.strategies]\nhalf = pk_half:GoodStrategy\n"
    )
    (site / "parallelkit_half-0.3.dist-info" / "METADATA").unlink()
    return site


@pytest.fixture(scope="module")
def first_trainers(site: Path) -> str:
    """What a fresh interpreter with `site` on its path prints: which plugins `import parallelkit` loaded, the
    warnings of the first Trainer (which loads and registers them all), and the strategies built by name."""
    code = (
        "import sys, warnings\n"
        "warnings.simplefilter('always')\n"
        "import parallelkit\n"
        "print('LOADED AT IMPORT', sorted(m for m in ('pk_good', 'pk_broken', 'lightning') if m in sys.modules))\n"
        "import lightning as L\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    trainer = L.Trainer(strategy='good', accelerator='cpu', devices=1, logger=False)\n"
        "for w in caught: print('WARNING', w.message)\n"
        "print('STRATEGY', type(trainer.strategy).__name__)\n"
        "trainer = L.Trainer(strategy='future', accelerator='cpu', devices=1, logger=False)\n"
        "print('STRATEGY', type(trainer.strategy).__name__)\n"
    )
    proc = run([sys.executable, "-c", code], cwd=site.parent, PYTHONPATH=str(site))
    assert_ok(proc)
    return proc.stdout


def test_broken_plugin_warns_with_its_distribution_and_others_still_register(first_trainers: str):
    """Imported first, parallelkit loads no plugin (nor Lightning); the first Trainer loads and registers them all:
    the broken one and the clash are warnings naming the distribution, the good one is built by name."""
    assert "LOADED AT IMPORT []" in first_trainers
    assert "parallelkit-broken 0.3 failed to load" in first_trainers and "boom at import" in first_trainers
    assert "'ddp' from parallelkit-good 0.3 is skipped" in first_trainers  # clashes with Lightning's own ddp
    assert "STRATEGY GoodStrategy" in first_trainers


def test_plugin_for_another_api_version_warns_with_both_versions_and_still_registers(first_trainers: str):
    assert "'future' from parallelkit-future 0.3 was written for parallelkit plugin API 99" in first_trainers
    assert "provides plugin API 1" in first_trainers and "upgrade parallelkit" in first_trainers
    assert "STRATEGY FutureStrategy" in first_trainers


def test_plugins_command_lists_good_and_broken_plugins(site: Path):
    """...and one whose distribution has no METADATA (mid-install), as of an unknown distribution: a run on another
    worker once failed in every rank, sorting plugins by a distribution name that was None, while a test reinstalled
    a plugin with pip."""
    proc = parallelkit("plugins", cwd=site.parent, PYTHONPATH=str(site))
    assert_ok(proc)
    rows = proc.stdout
    assert "good" in rows and "parallelkit-good 0.3" in rows
    assert "broken" in rows and "RuntimeError: boom at import" in rows
    assert "name clash" in rows
    assert "half" in rows and "<unknown> ?" in rows


def test_builtin_strategies_are_registered_when_the_registry_is_read():
    from lightning.pytorch.strategies import StrategyRegistry

    import parallelkit  # noqa: F401
    from parallelkit.plugins import STRATEGY_GROUP, discover

    own = {p.name for p in discover(STRATEGY_GROUP) if p.distribution == "parallelkit" and p.error is None}
    assert {"fsdp_tp", "fsdp2", "tp", "hsdp"} <= own
    assert own <= set(StrategyRegistry.available_strategies())


def test_registering_twice_is_harmless():
    from parallelkit.plugins import register_strategies

    register_strategies()
    register_strategies()


def test_the_core_never_imports_a_plugin():
    import ast

    from support import REPO

    plugin_packages = {p.name for p in (REPO / "plugins").glob("*/src/*") if p.is_dir()}
    assert {"parallelkit_diloco", "parallelkit_template"} <= plugin_packages
    for path in (REPO / "src").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            assert not any(m.split(".")[0] in plugin_packages | {"plugins"} for m in modules), (path, modules)
