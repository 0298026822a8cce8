"""The interpreter's own exit steps, taken one by one: `threading._shutdown` and `atexit._run_exitfuncs`."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_without_finalising(code: int) -> NoReturn:
    """End the process as the interpreter ends it (non-daemon threads joined, atexit handlers run, standard streams
    flushed), then leave with `code` before its finalisation: the teardown of every module and the C++ static
    destructors.

    A finished gloo run can abort there ("terminate called without an active exception", exit -6, pytorch#190489):
    `destroy_process_group`, which an atexit handler calls (`destroy_process_groups_at_exit`), unregisters the
    groups but leaves their worker threads running while any object still refers to a group (FSDP's and the mesh's
    do, from reference cycles that the exit never collects: the CLI freezes them, `gc.freeze`), and those threads then
    meet an interpreter that is being torn down."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or its reader gone: nothing left to write it to
            stream.flush()
    os._exit(code)
