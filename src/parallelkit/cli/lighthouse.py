"""`parallelkit lighthouse`: the server replica groups ask which groups take part in each step (torchft's)."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Sequence

from parallelkit.errors import ConfigError


def lighthouse_command(argv: Sequence[str]) -> int:
    """Run torchft's lighthouse until Ctrl-C or SIGTERM: replica groups (`replica_groups.lighthouse`) ask it for
    each step's quorum; a group that stops answering for the heartbeat timeout leaves the next one."""
    parser = argparse.ArgumentParser(prog="parallelkit lighthouse", description=lighthouse_command.__doc__)
    parser.add_argument("--port", type=int, default=29510, help="the port to serve on (default: %(default)s)")
    parser.add_argument(
        "--min-groups", type=int, default=1, help="the fewest groups a quorum forms with (default: %(default)s)"
    )
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=60_000,
        help="how long a quorum waits for every known group before forming without some (default: %(default)s)",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5_000,
        help="how long a silent group stays in the quorum (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as err:
        fix = "Fix: pip install 'parallelkit[ft]'."
        raise ConfigError(f"parallelkit lighthouse runs torchft's lighthouse ({err}). {fix}") from err
    server = LighthouseServer(
        bind=f"[::]:{args.port}",
        min_replicas=args.min_groups,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
    )
    address = server.address()
    print(f"lighthouse at {address}: start each group with replica_groups.lighthouse={address}", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0
