"""Starts the tests' jobs by forking a process that imported the CLI once: what `python -m parallelkit.cli ...` (and
the N-1 ranks Lightning's launcher then starts) does, without 6-7 CPU-seconds of imports (torch, Lightning and what
Lightning's torchmetrics pulls in) per process. `support.launch` is the client; tests/README.md says when a test
needs a real launch instead.

A job is a *leader* forked from this server in a session of its own (the test can signal one rank or the whole job,
as SLURM or torchrun would) and the ranks the leader forks:

- By default a job starts as `parallelkit ...` (or `python SCRIPT ...`) does: one process runs the program, parses,
  refuses or goes on, and Lightning's launcher (`_SubprocessScriptLauncher`) starts ranks 1..N-1 with the variables
  it always sets. Only the way those start differs: instead of executing `sys.argv` again, the launcher asks the
  leader (a pipe) to fork them from its own warm state, and they run the same program and arguments, as Lightning's
  re-execution would.
- With `nprocs`, as torchrun starts a program: N ranks at once with torchrun's variables.

The leader ends every rank once one fails (as Lightning's launcher and torchrun do) and writes the job's exit status
to `status` in the job's directory: the first failing rank's exit code, else 0. Ranks write to the job's `stdout`
and `stderr` files as a launcher's children share its pipes; `ranks` lists their pids by rank.

Protocol on stdin/stdout, one JSON object per line: in, {"script" (null: the `parallelkit` command), "args", "cwd",
"env", "dir", "nprocs" (null: Lightning's launcher)}; out, {"pid"} (the leader's, at once: jobs run side by side).
Forking is safe because this process never computes: torch's thread pools have not started.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import select
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch.strategies.launchers.subprocess_script as lightning_launcher
import transformers.models.llama.modeling_llama  # noqa: F401 - the Hugging Face family most runs build
from lightning.fabric.utilities import rank_zero
from typing_extensions import override

import parallelkit.callbacks  # noqa: F401 - what a run imports once the CLI has parsed, imported once here
import parallelkit.cli as cli
import parallelkit.cli.lightning_cli  # noqa: F401 - `fit` and the rest: LightningCLI
import parallelkit.data  # noqa: F401
import parallelkit.models.hf  # noqa: F401
import parallelkit.strategies  # noqa: F401
from parallelkit.compat import exit_without_finalising


def serve() -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # leaders reaped at once: the client reads a job's status file
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            lead(request)  # never returns
        sys.stdout.write(json.dumps({"pid": pid}) + "\n")
        sys.stdout.flush()


def lead(request: dict) -> None:
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # this process waits for its ranks
    job = Path(request["dir"])
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    outputs = os.open(job / "stdout", flags), os.open(job / "stderr", flags)
    requests, replies = os.pipe(), os.pipe()  # rank 0's launcher asks for ranks 1..N-1 here
    pipes = {"leader": [requests[0], replies[1]], "rank 0": [requests[1], replies[0]]}
    ranks: dict[int, int] = {}  # pid -> rank

    def start(rank: int, env: dict[str, str], cwd: str, main: bool) -> int:
        pid = os.fork()
        if pid == 0:
            mine = pipes["rank 0"] if main else []
            for fd in pipes["leader"] + pipes["rank 0"]:
                if fd not in mine:
                    os.close(fd)
            if mine:
                _launch_ranks_through(*mine)
            run_rank(request, env, cwd, outputs)  # never returns
        ranks[pid] = rank
        (job / "ranks.new").write_text(json.dumps(sorted(ranks, key=ranks.get)))
        os.replace(job / "ranks.new", job / "ranks")  # whole: the test reading it never sees it half written
        return pid

    if nprocs := request["nprocs"]:
        for rank in range(nprocs):
            start(rank, {**request["env"], **torchrun_variables(rank, nprocs)}, request["cwd"], main=False)
    else:
        start(0, request["env"], request["cwd"], main=True)
    for fd in pipes.pop("rank 0"):
        os.close(fd)
    pipes["rank 0"] = []
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a signal to the whole job is for the ranks: this one reports
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = supervise(ranks, requests[0], replies[1], lambda child: start(len(ranks), **child, main=False))
    (job / "status.tmp").write_text(str(code))
    os.replace(job / "status.tmp", job / "status")
    os._exit(0)


def supervise(ranks: dict[int, int], requests: int, replies: int, start) -> int:
    """Wait for every rank, forking those rank 0's launcher asks for; once one fails, SIGKILL the rest (Lightning's
    launcher does the same). Returns the first failure's exit code (the lowest rank's among those seen together); a
    rank that rank 0's launcher ends itself (SIGKILL as rank 0 exits, on Ctrl-C) is not a failure."""
    alive, code, pending, ended_by_rank_0 = set(ranks), None, b"", set()
    listening = [requests]

    def read_requests(timeout: float) -> None:
        nonlocal pending, listening
        if not (listening and select.select(listening, [], [], timeout)[0]):
            return
        chunk = os.read(requests, 1 << 20)
        if not chunk:
            listening = []
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if "ending" in request:  # rank 0's launcher SIGKILLs its children as it ends: not their failure
                ended_by_rank_0.add(request["ending"])
                continue
            pid = start(request)
            alive.add(pid)
            os.write(replies, f"{pid}\n".encode())

    while alive:
        if listening:
            read_requests(0.02)
        else:
            select.select([], [], [], 0.02)
        ended = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            alive.discard(pid)
            ended.append((pid, os.waitstatus_to_exitcode(status)))
        read_requests(0)  # rank 0 says it ends a child before it signals it: a child reaped here is known by now
        failures = sorted((ranks[pid], rc) for pid, rc in ended if rc != 0 and pid not in ended_by_rank_0)
        if failures and code is None:
            code = failures[0][1]
            for pid in alive:
                os.kill(pid, signal.SIGKILL)
    return code or 0


def torchrun_variables(rank: int, nprocs: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "MASTER_ADDR": "127.0.0.1",
    }


class ForkedChild:
    """What Lightning's launcher keeps of a rank it started (a `subprocess.Popen` there): its pid, for the signals it
    forwards (SIGTERM to rank 0 reaches the others). Its process observer polls it; the leader is the one that
    watches the ranks, so `poll` reports it running."""

    returncode = None

    def __init__(self, pid: int, requests: int) -> None:
        self.pid = pid
        self.requests = requests

    def poll(self) -> None:
        return None

    def send_signal(self, signum: int) -> None:
        if signum == signal.SIGKILL:  # the launcher ending its children (Ctrl-C): the leader must not count it
            os.write(self.requests, json.dumps({"ending": self.pid}).encode() + b"\n")
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)


def _launch_ranks_through(requests: int, replies: int) -> None:
    """In rank 0 of a parallelkit job: Lightning's launcher starts each rank by asking the leader for a fork."""
    answers = os.fdopen(replies, "rb", buffering=0)

    def popen(command: list[str], env: dict[str, str], cwd: str | None = None) -> ForkedChild:
        os.write(requests, json.dumps({"env": env, "cwd": cwd or os.getcwd()}).encode() + b"\n")
        line = b""
        while not line.endswith(b"\n"):
            line += answers.read(1)
        return ForkedChild(int(line), requests)

    lightning_launcher.subprocess = type("Subprocess", (), {"Popen": staticmethod(popen)})


def run_rank(request: dict, env: dict[str, str], cwd: str, outputs: tuple[int, int]) -> None:
    """Become one rank: the request's working directory, environment and arguments, this job's output files, and
    the signal handlers and rank a fresh interpreter would have. Ends the process as the interpreter ends (threads
    joined, atexit handlers run, output flushed) with the command's exit code, without tearing down its
    modules."""
    for signum in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(outputs[0], 1)
    os.dup2(outputs[1], 2)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    rank_zero.rank_zero_only.rank = rank_zero._get_rank() or 0  # what Lightning sets at import, from the variables
    # The path a fresh interpreter would have: the script's directory or, for `python -m`, the working directory
    # first (not this server's), then the job's PYTHONPATH entries, then the rest (support.forkable refuses entries
    # that run code at start-up).
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    script = request["script"]
    sys.path[:1] = [str(Path(script).parent) if script else os.getcwd(), *extra]
    for entry in extra:  # what the interpreter runs at start from its path (support.forkable allows patches only)
        if (Path(entry) / "sitecustomize.py").exists():
            runpy.run_path(str(Path(entry) / "sitecustomize.py"), run_name="sitecustomize")
    code = 0
    try:
        if script:
            sys.argv = [script, *request["args"]]
            runpy.run_path(script, run_name="__main__")
        else:
            sys.argv = ["parallelkit", *request["args"]]
            cli.main()
    except SystemExit as stop:  # what the interpreter would make of it
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - an uncaught error: the traceback the interpreter prints
        traceback.print_exc()
        code = 1
    # What the interpreter does as it exits (non-daemon threads joined, atexit handlers run, output flushed), then
    # out: the rest of its finalization, tearing down every module torch and Lightning loaded, takes a few tenths of
    # a second of each rank of each job and writes nothing. A finished distributed `parallelkit` run has ended this
    # way already, inside `cli.main` (`cli.end_finished_run`), as it does launched for real.
    exit_without_finalising(code)


class _Parsed(Exception):
    """Raised by `parse_once` once the command line is parsed: nothing more of the CLI runs."""


def parse_once() -> None:
    """Parse `parallelkit fit --config configs/hybrid.yaml` here once, then stop: what jsonargparse keeps of the
    classes a parse meets (their signatures read from source, a parser per class) is then in every fork, as the
    imports are. A real rank reads them in its first parse: measured, a 4-rank job's ranks spend 0.62 CPU-s
    instead of 0.77 before `setup`. Nothing is built (no seed, no Trainer, no model): this process still never
    computes. The real launches keep a first parse from scratch under test (the README's main command parses this
    same config in each of its ranks)."""
    from parallelkit.cli.lightning_cli import ParallelkitCLI

    class ParseOnly(ParallelkitCLI):
        @override
        def parse_arguments(self, parser: Any, args: Any) -> None:
            super().parse_arguments(parser, args)
            raise _Parsed

    config = Path(__file__).resolve().parents[2] / "configs" / "hybrid.yaml"
    with contextlib.suppress(_Parsed), contextlib.redirect_stdout(sys.stderr):  # stdout is the protocol's
        ParseOnly(args=["fit", "--config", str(config)])


if __name__ == "__main__":
    parse_once()
    serve()
