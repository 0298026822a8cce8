"""pytest's hooks and the session fixtures; the helpers they and the tests use are in support.py."""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from snippets import parallelkit_args
from support import (
    CORPUS_CHARS,
    RESUME_AT,
    SINGLE_PROCESS,
    STEPS,
    Reference,
    assert_ok,
    callback,
    checkpoint_every,
    common,
    fit,
    fit_command,
    made_once,
)

SERIAL_FILES = ("test_plugins.py", "test_output.py", "test_diloco.py", "test_template.py")
"""Test files that uninstall and reinstall a plugin in this environment, or read the installed plugins or every
warning a run prints: under pytest-xdist they run one after another on one worker, so that no other test's process
meets a plugin half-installed."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-hogs",
        type=int,
        default=0,
        help="start this many busy processes (one per core loads the machine) for the whole run: the suite must pass "
        "on a loaded machine too (tests/README.md)",
    )


_HOGS: list = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    for hog in _HOGS:
        hog.kill()
        hog.wait()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadfile` (pyproject's addopts), with SERIAL_FILES as one file: each worker runs whole files, so a
    file's module fixtures are made once."""
    from xdist.scheduler import LoadFileScheduling

    class ByFile(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return "SERIAL_FILES" if Path(file).name in SERIAL_FILES else file

    return ByFile(config, log) if config.getvalue("dist") == "loadfile" else None


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small deterministic text corpus: the first 400 KB of the standard library sources the default data reads.

    Not this repository's own source (as it once was): then every edit to `src/` changed the data, and the tests
    whose bounds depend on it (reduced-precision gradients against fp32) passed or failed with unrelated changes."""
    from parallelkit.data.text import default_corpus_files

    def make(directory: Path) -> None:
        text, files = "", iter(default_corpus_files())
        while len(text) < CORPUS_CHARS:
            text += next(files).read_text()
        (directory / "corpus.txt").write_text(text[:CORPUS_CHARS])

    return made_once(tmp_path_factory, "corpus", make) / "corpus.txt"


@pytest.fixture(scope="session")
def pretrained_llama(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Callable[..., Path]:
    """`pretrained_llama(name, tokenizer=True, max_shard_size=None, **sizes)`: a user's model directory as
    `save_pretrained` writes it: a Llama of `models.TINY_LLAMA`'s sizes (`sizes` change them) drawn from seed 7 (not
    the runs' seed: weights a run initialised itself would not match), in safetensors shards of `max_shard_size`,
    with its own tokenizer beside it (`models.save_tokenizer`, learnt from the corpus). Made once per session."""
    import torch
    from models import TINY_LLAMA, save_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    def get(name: str, tokenizer: bool = True, max_shard_size: str | None = None, **sizes: object) -> Path:
        def make(directory: Path) -> None:
            torch.manual_seed(7)
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **{**TINY_LLAMA, **sizes}))
            model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
            if tokenizer:
                save_tokenizer(directory, corpus)

        return made_once(tmp_path_factory, f"pretrained-{name}", make)

    return get


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Callable[..., Reference]:
    """`reference(config, *overrides)`: a `STEPS`-step run of configs/<config> that checkpoints at step `RESUME_AT`,
    made on first use and shared by every test of the session that compares with the same run."""

    def make(run: Path, config: str, overrides: tuple[str, ...]) -> None:
        checkpoint = checkpoint_every(run / "ckpt", RESUME_AT)
        assert_ok(fit(config, run / "log", *common(corpus, run / "cache"), checkpoint, *overrides))

    def get(config: str, *overrides: str) -> Reference:
        key = hashlib.sha1(json.dumps([config, *overrides]).encode()).hexdigest()[:12]
        run = made_once(tmp_path_factory, f"reference-{key}", lambda run: make(run, config, overrides))
        return Reference(run / "log", run / "ckpt" / f"epoch=0-step={RESUME_AT}.ckpt")

    return get


@pytest.fixture(scope="session")
def baseline(reference: Callable[..., Reference]) -> Callable[[str], Reference]:
    """`baseline(name)`: the single-process run of a SINGLE_PROCESS variant."""
    return lambda name: reference("single.yaml", *SINGLE_PROCESS[name])


@pytest.fixture(scope="session")
def sft_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`sft_runs(name, *overrides)`: a `STEPS`-step run of configs/sft.yaml on the built-in conversations, made once in
    the session (test_sft.py's layouts, and the one-process reference replica groups of token batches compare with)."""

    def get(name: str, *overrides: str) -> Path:
        def make(directory: Path) -> None:
            common = (
                f"--trainer.max_steps={STEPS}",
                "--trainer.limit_val_batches=0",
                f"--data.init_args.cache_dir={directory.parent / 'sft-cache'}",
            )
            assert_ok(fit("sft.yaml", directory, *common, *overrides))

        return made_once(tmp_path_factory, f"sft-{name}", make)

    return get


@pytest.fixture(scope="session")
def fsdp4_fp32(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """hybrid.yaml on [[4, 1]] for `STEPS` steps with the fp32 comm hook and profile_communication, each rank writing
    its training-state bytes at the end (`models.StateBytes`, under `<dir>/state`): its CSV log directory. One launch
    for test_comm.py's fp32 runs and test_fsdp_tp.py's sharded training-state measure, which each made it before (the
    monitor and the callback only observe: the losses stay one process's)."""

    def make(root: Path) -> None:
        assert_ok(
            fit_command(
                parallelkit_args("three-ways-in", 1),  # the README's [[4, 1]] command
                root,
                *common(corpus, root / "cache"),
                "--data.init_args.batch_size=2",  # the global batch of 8 over 4 ranks
                "--trainer.strategy.comm_precision=fp32",
                "--trainer.strategy.profile_communication=true",
                callback("models.StateBytes", out_dir=str(root / "state")),
            )
        )

    return made_once(tmp_path_factory, "fsdp4_fp32", make)


@pytest.fixture(scope="session")
def ddp_fp32(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """configs/ddp.yaml (2 processes) under parallelkit's DDPStrategy (the `ddp_comm` preset's class) with the fp32
    hook (its default) and profile_communication, `STEPS` steps: its CSV log directory. One launch for test_comm.py's
    DDP hook test and how the ranks of a finished real launch end (test_cli.py, `models.ExitMarks` under `exit/`).
    Launched through `python -m parallelkit.cli` and Lightning's own launcher: the production path, once for DDP
    (tests/README.md)."""
    ddp = [
        "--trainer.strategy=parallelkit.DDPStrategy",
        "--trainer.strategy.comm_precision=fp32",
        "--trainer.strategy.profile_communication=true",
    ]

    def make(root: Path) -> None:
        exits = callback("models.ExitMarks", out_dir=str(root / "exit"))  # how each rank ended: test_cli.py
        assert_ok(fit("ddp.yaml", root, *common(corpus, root / "cache"), *ddp, exits, real_launch=True))

    return made_once(tmp_path_factory, "ddp_fp32", make)


LAUNCHING_CALLS = {"fit", "parallelkit", "torchrun", "script", "launch", "training_in_background"}
"""support.py's helpers that start processes (by name), besides subprocess's own functions (`SUBPROCESS_CALLS`)."""

SUBPROCESS_CALLS = {"run", "Popen", "check_call", "check_output", "call", "spawn"}


def _names(function: Callable[..., object]) -> set[str]:
    """The names and attributes `function` refers to: its compiled code's (nested functions' too) and, where its
    source parses on its own, the source's (a lambda in a table does not)."""
    names: set[str] = set()
    codes = [getattr(function, "__code__", None)]
    while codes:
        code = codes.pop()
        if code is not None:
            names.update(code.co_names)
            codes += [c for c in code.co_consts if inspect.iscode(c)]
    try:
        tree = ast.parse(inspect.getsource(function).lstrip())  # a method's source is indented
    except (OSError, TypeError, SyntaxError):
        return names
    return names | {getattr(node, "id", None) or getattr(node, "attr", "") for node in ast.walk(tree)}


def _launches(item: pytest.Item) -> bool:
    """Whether the test, a fixture it uses, or a function of the tests' own that they call (transitively) starts a
    process: calls a launching helper or one of subprocess's functions."""
    import support

    functions = [item.function]
    for definitions in item._fixtureinfo.name2fixturedefs.values():
        functions += [definition.func for definition in definitions]
    callspec = getattr(item, "callspec", None)  # a parameter may be the launch itself (a lambda from a table)
    functions += [v for v in (callspec.params.values() if callspec else ()) if callable(v)]
    tests = str(Path(__file__).resolve().parent)
    scopes = [
        vars(m) for m in list(sys.modules.values()) if getattr(m, "__file__", "") and m.__file__.startswith(tests)
    ]
    scopes += [vars(item.module), vars(support)]
    seen: set[int] = set()
    while functions:
        function = functions.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        names = _names(function)
        if names & LAUNCHING_CALLS or "Popen" in names or ("subprocess" in names and names & SUBPROCESS_CALLS):
            return True
        for scope in scopes:
            for value in (scope[n] for n in names if n in scope):
                values = (
                    value.values()
                    if isinstance(value, dict)
                    else value
                    if isinstance(value, (list, tuple))
                    else [value]
                )
                functions += [v for v in values if callable(v) and _in_tests(v)]  # a table of launches too
    return False


def _in_tests(function: object) -> bool:
    path = getattr(getattr(function, "__code__", None), "co_filename", "")
    return path.startswith(str(Path(__file__).resolve().parents[1]))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that starts processes `launch` (`pytest -m "not launch"`: the fast inner loop)."""
    for item in items:
        if isinstance(item, pytest.Function) and _launches(item):
            item.add_marker(pytest.mark.launch)


def pytest_sessionstart(session: pytest.Session) -> None:
    """With `--cpu-hogs=N`, N processes that spin on a core each until the run ends (started once, by the process
    that runs the workers). With PARALLELKIT_TEST_NO_PROCESSES=1, starting a process fails the test: how the `launch`
    marks are checked (`PARALLELKIT_TEST_NO_PROCESSES=1 pytest -m "not launch" -p no:xdist`)."""
    count = session.config.getoption("cpu_hogs")
    if count and not os.environ.get("PYTEST_XDIST_WORKER"):
        import subprocess

        _HOGS.extend(subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count))
    if os.environ.get("PARALLELKIT_TEST_NO_PROCESSES") == "1":
        import subprocess

        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError(f"a test not marked launch starts a process: {args[1:2]}")

        subprocess.Popen.__init__ = refuse  # type: ignore[method-assign]
