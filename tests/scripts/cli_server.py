"""Runs `parallelkit` commands that start no other process, each in a fork of this process, which imported the CLI
once: what a fresh `python -m parallelkit.cli ...` does, without its 7 seconds of imports (torch, Lightning and what
Lightning's torchmetrics pulls in) per command. `support.parallelkit(..., fork=True)` is the client.

Protocol, one JSON object per line: in, {"args", "cwd", "env", "stdout", "stderr", "timeout"}; out, {"returncode"}.
The child takes the request's working directory and environment, writes its output to the two files, and calls
`parallelkit.cli.main` with the arguments as a console script would; it is killed past `timeout` (returncode -9).
This process itself never computes anything, so forking it (torch's thread pools not started) is safe.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

import parallelkit.cli as cli  # noqa: E402 - the import every command would otherwise pay


def run(request: dict) -> int:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = ["parallelkit", *request["args"]]
    code = 0
    try:
        cli.main()
    except SystemExit as stop:  # what the interpreter would make of it
        if isinstance(stop.code, int) or stop.code is None:
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - an uncaught error: the traceback a console script prints
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL
        time.sleep(0.02)


def serve() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os._exit(run(request))
        sys.stdout.write(json.dumps({"returncode": wait(pid, request["timeout"])}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
