"""The `parallelkit` command: LightningCLI's fit/validate/test/predict (`lightning_cli`), plus the tools, one module
each (`env`, `plugins`, `consolidate`, `export_hf`, `plan`, `check`, `lighthouse`), imported when named: a tool that
needs no Lightning does not load it.

parallelkit fit --config configs/ddp.yaml --trainer.max_steps=20
parallelkit env --mesh '[[2, 2], ["fsdp", "tp"]]' --devices 4
parallelkit plugins
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from os import _exit  # documented (os._exit): the SIGINT handler ends the process before anything needs a clean exit
from pathlib import Path
from typing import NoReturn

from parallelkit.cli.config import read_config
from parallelkit.compat import exit_without_finalising, quiet_known_noise
from parallelkit.errors import ParallelkitError

TOOLS_HELP = """\
tools (no model, no training):
  parallelkit env [--mesh SHAPE --devices N]   versions, backends, devices, launcher env, a mesh's rank layout
  parallelkit plugins                          every discovered strategy and comm hook, and load errors
  parallelkit consolidate CKPT_DIR OUT.pt      a sharded checkpoint's weights as one plain state dict
  parallelkit export-hf CKPT OUT_DIR           an HFCausalLM checkpoint as a Hugging Face model directory
                                               (--adapters: a LoRA run's adapters in PEFT's format; a non-empty
                                               OUT_DIR only with --overwrite, which keeps files it does not write)
  parallelkit plan --config RUN.yaml --nodes N --devices-per-node G --device-memory 80GB
                                               every valid mesh's memory and communication, and a recommendation
  parallelkit check --config RUN.yaml          launched as fit: every rank's device and versions, collectives per
                                               mesh axis with deadlines (--dry-run --nodes N --devices-per-node G:
                                               the real plan applied in one process with a fake process group)
  parallelkit lighthouse [--port 29510 --min-groups 1]
                                               torchft's lighthouse, which replica groups ask for each step's quorum
"""

TOOLS = {
    "env": "env:env_command",
    "plugins": "plugins:plugins_command",
    "consolidate": "consolidate:consolidate_command",
    "export-hf": "export_hf:export_hf_command",
    "plan": "plan:plan_command",
    "check": "check:check_command",
    "lighthouse": "lighthouse:lighthouse_command",
}
"""Each tool's command: its module in this package and its function, imported when the tool is run."""


RUNS = ("fit", "validate", "test", "predict")
"""LightningCLI's subcommands: the ones that launch ranks."""


def tool(name: str) -> Callable[[Sequence[str]], int]:
    """The function that runs the tool `name` (its module imported now)."""
    module, _, function = TOOLS[name].partition(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), function)


REPORT_GRACE_S = 10.0
"""How long a rank other than 0 waits for rank 0 to report the error they both met before reporting its own."""


def report(err: ParallelkitError, launcher_pid: int) -> None:
    """Print `err` as parallelkit's one-paragraph error on stderr, once per job.

    An error after launch (planning the model, the first batch) usually stops every rank at the same point. Global
    rank 0 reports it. Lightning's launcher started ranks 1..N-1 as rank 0's children (`launcher_pid`: the parent
    when this process started), and torchrun ends every rank once one fails: another rank stays silent if rank 0 ends
    within the grace period, and reports its own error otherwise (one rank 0 did not meet).
    """
    if global_rank() and rank_zero_ended(launcher_pid):
        return
    print(f"parallelkit: error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)


def global_rank() -> int:
    """This process's global rank as Lightning knows it; before Lightning is loaded, as Lightning will read it from
    the launcher's variables (0 in the process the user started, and in a tool's)."""
    utilities = sys.modules.get("lightning.pytorch.utilities")
    rank = getattr(getattr(utilities, "rank_zero_only", None), "rank", None)
    if rank is None:
        variables = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
        rank = next((os.environ[name] for name in variables if name in os.environ), 0)
    return int(rank or 0)


def rank_zero_ended(launcher_pid: int) -> bool:
    """On a rank Lightning's launcher started as rank 0's child: whether rank 0 (the parent, `launcher_pid`) ends
    within REPORT_GRACE_S."""
    deadline = time.monotonic() + REPORT_GRACE_S
    while os.getppid() == launcher_pid and time.monotonic() < deadline:
        time.sleep(0.1)
    return os.getppid() != launcher_pid


def end_finished_run() -> None:
    """A run that finished in a process of a distributed job ends here, with exit status 0, after the atexit handlers
    (process groups destroyed, loggers closed) and without the interpreter's finalisation, where gloo's worker threads
    can abort it ("terminate called without an active exception": `compat.exit_without_finalising`) and torchrun or
    SLURM then report a job that trained and saved everything as failed. A run in one process without a process
    group returns as usual."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        exit_without_finalising(0)


def said_interrupted_before(subcommand: str, launcher_pid: int) -> None:
    """Ctrl-C before CTRL_C is armed: rank 0 says nothing was kept; another rank (Lightning's launcher started it)
    waits for rank 0 to end first, as an interrupted rank does."""
    if global_rank():
        rank_zero_ended(launcher_pid)
    else:
        print(interrupted_before(subcommand), file=sys.stderr, flush=True)


def end_before_armed(subcommand: str, launcher_pid: int) -> NoReturn:
    """The SIGINT handler until CTRL_C is armed: nothing is running yet that would keep anything (no process group,
    no rank launched, no file being written), so the process ends at once with 130 once it has said so."""
    said_interrupted_before(subcommand, launcher_pid)
    sys.stdout.flush()
    _exit(128 + signal.SIGINT)


def interrupted_before(subcommand: str) -> str:
    """What rank 0 says when Ctrl-C stops `subcommand` before it has anything to keep."""
    if subcommand == "fit":
        return "parallelkit: interrupted before training started: nothing was trained or saved."
    return f"parallelkit: {subcommand} interrupted."


def _config_files(args: Sequence[str]) -> list[str]:
    """The files given to `--config`/`-c`: those that exist, and those named like a config file that do not
    (jsonargparse also takes inline YAML there, and reports a missing file inside a screen of usage)."""
    paths = [b for a, b in zip(args, args[1:]) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    return [p for p in paths if Path(p).is_file() or p.endswith((".yaml", ".yml", ".json"))]


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `parallelkit` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    launcher_pid = os.getppid()
    run = args[0] if args and args[0] in RUNS else None
    interrupted, armed = 128 + signal.SIGINT, False
    if run is not None and threading.current_thread() is threading.main_thread():
        # Ctrl-C heard from the first instant, until CTRL_C is armed: also in a job whose parent ignores SIGINT (a
        # script's background job), which armed CTRL_C hears later. The process ends in the handler (it has nothing
        # to keep yet), not by a KeyboardInterrupt raised inside whatever is importing: numpy, interrupted in the
        # middle of its import under torch's, was left half-initialised and recursed (once, on a loaded machine).
        signal.signal(signal.SIGINT, lambda signum, frame: end_before_armed(run, launcher_pid))
    quiet_known_noise()  # before a tool or a model imports transformers, which imports torchao
    try:
        if args and args[0] in TOOLS:
            sys.exit(tool(args[0])(args[1:]))
        if not args or args[0] in ("-h", "--help"):
            print(TOOLS_HELP)
        if run is not None:
            from parallelkit.callbacks.preemption import CTRL_C

            CTRL_C.arm(interrupted_before(run))  # Ctrl-C: saves what training did, or ends at once before it
            armed = True
        for path in _config_files(args):
            read_config(path)  # jsonargparse's YAML errors do not name the file
        from parallelkit import plugins
        from parallelkit.cli.lightning_cli import ParallelkitCLI

        plugins.activate()  # strategies registered and known noise quieted before any model is built
        # Lightning re-runs sys.argv for ranks 1..N-1, so the arguments must come from there unchanged.
        ParallelkitCLI(args=None if argv is None else args)
        if argv is None and run is not None:
            end_finished_run()
    except KeyboardInterrupt:
        if run is None or armed:  # a tool's, or Lightning's own handling let it through
            raise
        # A KeyboardInterrupt before CTRL_C was armed, with no handler of ours (main called off the main thread).
        said_interrupted_before(run, launcher_pid)
        sys.exit(interrupted)
    except SystemExit as stop:
        if stop.code == interrupted and global_rank():
            # Interrupted: rank 0 speaks for the job, and a launcher that saw this rank end first would end rank 0
            # before it has (Lightning's SIGKILLs it).
            rank_zero_ended(launcher_pid)
        raise
    except Exception as err:
        # jsonargparse raises a constructor's error (a model's or datamodule's argument check) from its own.
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, ParallelkitError):
            cause = cause.__cause__
        if cause is None:
            if global_rank() and rank_zero_ended(launcher_pid):
                # Rank 0 failed alone (e.g. in prepare_data, which only it runs) and said why; this rank's error is
                # the consequence: a collective whose peer is gone.
                sys.exit(1)
            raise
        report(cause, launcher_pid)
        sys.exit(2)
    finally:
        if argv is None:  # run as the program: the process ends now
            # Interpreter shutdown's last garbage collection walks every object torch and Lightning created (about
            # a second of CPU per process, so ~3 s of a 4-process job on 2 cores) to free the few reference cycles
            # left, memory the exiting process returns anyway. It skips frozen objects; the rest of shutdown runs
            # as usual (atexit handlers, files closed, process groups destroyed). A distributed run that finished
            # has ended before this, without shutdown's finalisation (`end_finished_run`).
            gc.freeze()
