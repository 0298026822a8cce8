"""The launched half of `parallelkit check`: every rank of the run's own mesh reports itself, then times collectives
over each mesh axis, each with a deadline.

Before any process group exists, the ranks meet on a TCPStore (MASTER_ADDR:MASTER_PORT, as `fit` would) with a
deadline: rank 0 names the ranks that never arrive. The store then stays the side channel of the check: before each
collective a rank writes where it is (`at/<rank>`), and a rank whose collective times out writes what it waited for
(`failed/<rank>`), so rank 0 can name the rank that stopped answering, and in which call, even when that rank is
still alive and silent.

This module holds that protocol: the store's side channel, the check every rank runs in step, what becomes of a
collective that times out, and rank 0's verdict. What a rank reports lives in `ranks.py`; the collectives, their
groups and their bandwidths in `collectives.py`.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import product
from typing import Any

import torch
import torch.distributed as dist

# Imported by name: check and measure look rank_report and run_collective up here, where the fault tests replace them
from parallelkit.check.collectives import Measurement, axis_groups, ops_of, run_collective, size_text
from parallelkit.check.ranks import _ranks, describe_differences, differences, rank_report
from parallelkit.errors import ParallelkitError
from parallelkit.mesh import MeshSpec

HETEROGENEOUS_ADVICE = (
    "Ranks of one job should run the same device type, memory and software: a slower or smaller device paces "
    "every collective and sets the memory limit of the whole layout, and different torch/NCCL builds can disagree "
    "on the wire. Fix: schedule the job on identical nodes (a SLURM constraint or partition of one GPU type) with one "
    "software image, or pass --allow-mixed if the mix is intended."
)


@dataclass
class Options:
    deadline: float = 60.0  # seconds a collective may take
    join_deadline: float = 300.0  # seconds the check waits for the next rank to join (from the last that did)
    sizes: tuple[int, ...] = (64 * 2**10, 2**20, 16 * 2**20)
    iters: int = 5
    allow_mixed: bool = False
    json: bool = False


# -- the side channel ---------------------------------------------------------------------------------------------
class Board:
    """The TCPStore every rank writes its state to: who joined, where each rank is, what failed."""

    def __init__(self, store: dist.Store, rank: int, world: int, deadline: float) -> None:
        self.store, self.rank, self.world, self.deadline = store, rank, world, deadline
        self.step = 0
        self.where = "joining"

    def put(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str) -> Any:
        return json.loads(self.store.get(key))

    def present(self, prefix: str) -> list[int]:
        return [r for r in range(self.world) if self.store.check([f"{prefix}/{r}"])]

    def at(self, where: str) -> None:
        self.step += 1
        self.where = where
        self.put(f"at/{self.rank}", {"step": self.step, "where": where})

    def wait_for(self, prefix: str, seconds: float, restart: bool = False) -> list[int]:
        """Wait up to `seconds` for every rank's `prefix/<rank>` key; returns the ranks still missing. `restart`: the
        `seconds` count again from each new key, so that ranks still arriving keep the wait alive (how long a loaded
        machine takes to start them all is not the question; a rank that is never coming is)."""
        end, seen = time.monotonic() + seconds, 0
        while True:
            missing = [r for r in range(self.world) if r not in self.present(prefix)]
            if restart and self.world - len(missing) > seen:
                end, seen = time.monotonic() + seconds, self.world - len(missing)
            if not missing or time.monotonic() > end:
                return missing
            time.sleep(0.05)

    def wait_for_key(self, key: str, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.store.check([key]):
                return True
            time.sleep(0.05)
        return False


def meet(host: str, port: int, rank: int, world: int, deadline: float) -> dist.Store:
    """The job's TCPStore, hosted by rank 0; a rank that cannot reach it within `deadline` raises, naming it."""
    try:
        return dist.TCPStore(
            host, port, world, is_master=rank == 0, timeout=timedelta(seconds=deadline), wait_for_workers=False
        )
    except (RuntimeError, dist.DistError) as err:
        raise CheckFailed(
            f"rank {rank} could not reach rank 0's store at {host}:{port} within {deadline:g} s ({_first_line(err)}). "
            "Check that MASTER_ADDR is an address of rank 0's node reachable from this one, that MASTER_PORT is "
            "open between nodes, and that rank 0 started."
        ) from err


class CheckFailed(ParallelkitError):
    """A finding that ends the check with a non-zero exit (its message is the finding): `parallelkit check` prints it
    as its own verdict (exit 1), before the CLI would report it as a usage error."""


def _first_line(err: BaseException) -> str:
    """An exception's first line, without gloo's source-location prefix ("[.../pair.cc:534] ")."""
    lines = str(err).strip().splitlines()
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", lines[0]) if lines else type(err).__name__
    return line[:300]


# -- the check, on every rank -------------------------------------------------------------------------------------
@dataclass
class Result:
    """What rank 0 prints: the ranks, the per-axis measurements, warnings and failures."""

    mesh: str
    reports: list[dict[str, Any]] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "mesh": self.mesh,
            "ranks": self.reports,
            "measurements": [m.as_dict() for m in self.measurements],
            "warnings": self.warnings,
            "failures": self.failures,
        }


def check(
    spec: MeshSpec,
    rank: int,
    device: torch.device,
    backend: str,
    address: tuple[str, int],
    options: Options,
) -> Result | None:
    """Run the check on this rank of `spec`; rank 0 returns the Result (the others None, or raise CheckFailed)."""
    world = spec.world_size
    result = Result(str(spec))
    board = Board(meet(*address, rank, world, options.join_deadline), rank, world, options.deadline)
    board.put(f"joined/{rank}", rank_report(rank, device))
    if rank == 0:
        missing = board.wait_for("joined", options.join_deadline, restart=True)
        if missing:
            board.put("verdict", {"go": False})
            result.failures.append(
                f"rank {_ranks(missing)} never joined: {world - len(missing)} of {world} ranks reached rank 0, and "
                f"none more in the {options.join_deadline:g} s after the last (--join-deadline). Check that process "
                "started (its "
                "launcher's log: a crash at import, a node that never came up, a job step stuck in the queue) and can "
                f"reach {address[0]}:{address[1]}."
            )
            result.reports = [board.get(f"joined/{r}") for r in board.present("joined")]
            return result
        result.reports = [board.get(f"joined/{r}") for r in range(world)]
        board.put("verdict", {"go": True})
    elif not board.wait_for_key("verdict", 2 * options.join_deadline) or not board.get("verdict")["go"]:
        raise CheckFailed(
            f"rank {rank}: rank 0 called the check off (another rank did not join); its output says which."
        )

    timeout = timedelta(seconds=options.deadline)
    dist.init_process_group(
        backend, store=dist.PrefixStore("pg", board.store), rank=rank, world_size=world, timeout=timeout
    )
    try:
        return measure(spec, board, result, device, options)
    finally:
        dist.destroy_process_group()


def measure(spec: MeshSpec, board: Board, result: Result, device: torch.device, options: Options) -> Result | None:
    rank, world = board.rank, board.world
    axes = [axis for axis, size in zip(spec.names, spec.sizes) if size > 1] or list(spec.names[:1])
    plan: list[Measurement] = []
    times: list[float] = []
    try:
        mine: dict[str, tuple[tuple[int, ...], Any]] = {}
        for axis in axes:  # every rank creates every group, in the same order
            for ranks in axis_groups(spec, axis):
                board.at(f"creating the {axis} group of ranks {_ranks(ranks)}")
                group = dist.new_group(list(ranks), timeout=timedelta(seconds=options.deadline))
                if rank in ranks:
                    mine[axis] = (ranks, group)
        for axis, op, size in ((a, o, s) for a in axes for o, s in product(ops_of(a), options.sizes)):
            ranks, group = mine[axis]
            n = len(ranks)
            if n == 1:  # a one-process run: nothing to time
                continue
            size = max(4 * n, size // (4 * n) * 4 * n)  # whole float32 elements, divisible by the group
            plan.append(Measurement(axis, op, size, n))
            board.at(f"{op} of {size_text(size)} on the {axis} group of ranks {_ranks(ranks)}")
            run_collective(op, size, group, ranks, rank, device)  # warm-up: connections, buffers
            start = time.perf_counter()
            for _ in range(options.iters):
                run_collective(op, size, group, ranks, rank, device)
            times.append((time.perf_counter() - start) / options.iters)
        board.at("gathering the timings on rank 0")
        local = torch.tensor(times, dtype=torch.float64, device=device)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
    except (RuntimeError, dist.DistError) as err:
        return failed(board, result, err, options)
    board.put(f"done/{rank}", True)
    if rank != 0:
        return None
    per_rank = torch.stack(gathered).cpu().tolist()
    for index, m in enumerate(plan):
        for ranks in axis_groups(spec, m.axis):
            m.seconds[ranks] = max(per_rank[r][index] for r in ranks)
    result.measurements = plan
    judge(spec, result, options)
    return result


def failed(board: Board, result: Result, err: BaseException, options: Options) -> Result | None:
    """A collective did not complete within the deadline: say so, and on rank 0 name who stopped answering."""
    rank = board.rank
    board.put(f"failed/{rank}", {"step": board.step, "where": board.where, "error": _first_line(err)})
    if rank != 0:
        board.wait_for_key("reported", 2 * options.deadline)  # rank 0 reports (and ends this process)
        raise CheckFailed(f"rank {rank}: {board.where}: no answer within {options.deadline:g} s ({_first_line(err)})")
    board.wait_for("failed", min(options.deadline, 5.0))  # the other ranks' own timeouts, if they are to come
    failures = {r: board.get(f"failed/{r}") for r in board.present("failed")}
    finished = set(board.present("done"))
    positions = {r: board.get(f"at/{r}") for r in board.present("at")}
    silent = [r for r in range(board.world) if r not in failures and r not in finished]
    if silent:
        for r in silent:
            where = positions.get(r, {}).get("where", "joining")
            result.failures.append(
                f"rank {r} stopped answering during: {where} (step {positions.get(r, {}).get('step', 0)} of the "
                f"check); the ranks waiting for it gave up after the deadline of {options.deadline:g} s. Look at that "
                "rank's process (py-spy dump --pid, its node's dmesg for GPU/XID errors), and for a network problem "
                "run with NCCL_DEBUG=INFO and set NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME to the interface the nodes "
                "share."
            )
    else:
        first = min(failures.values(), key=lambda f: f["step"])
        result.failures.append(
            f"every rank's collective timed out; the first: {first['where']} ({first['error']}). The ranks reached it "
            "but no data moved between them: check connectivity between their nodes (NCCL_SOCKET_IFNAME, "
            "NCCL_IB_DISABLE=1 to rule out InfiniBand, NCCL_DEBUG=INFO)."
        )
    for r, f in sorted(failures.items()):
        result.warnings.append(f"rank {r} waited in: {f['where']}: {f['error']}")
    board.put("reported", True)
    return result


def judge(spec: MeshSpec, result: Result, options: Options) -> None:
    """Warnings about the layout's placement (tp across nodes, an inner axis slower than an outer one) and the
    homogeneity verdict."""
    hosts = {r["rank"]: r["host"] for r in result.reports}
    if spec.size("tp") > 1:
        crossing = [g for g in axis_groups(spec, "tp") if len({hosts[r] for r in g}) > 1]
        if crossing:
            result.warnings.append(
                f"tp crosses nodes: the tp group of ranks {_ranks(crossing[0])} spans hosts "
                f"{', '.join(sorted({hosts[r] for r in crossing[0]}))}. Tensor parallelism communicates in every "
                "layer; keep it inside a node (tp <= devices per node, tp as the last mesh axis)."
            )
    largest = max(options.sizes)
    bandwidth = {
        m.axis: m.busbw(m.slowest) for m in result.measurements if m.op == "all_reduce" and m.size >= largest // 2
    }
    order = [a for a in spec.names if a in bandwidth]
    for outer, inner in zip(order, order[1:]):
        if bandwidth[inner] < 0.5 * bandwidth[outer]:
            result.warnings.append(
                f"the inner axis {inner} ({bandwidth[inner] / 1e9:.3g} GB/s bus bandwidth) is slower than the outer "
                f"axis {outer} ({bandwidth[outer] / 1e9:.3g} GB/s): inner axes should be the ranks closest together "
                "(the same node), where parallelism that communicates most (tp, then ep, fsdp) belongs."
            )
    found = differences(result.reports)
    if found:
        text = "; ".join(describe_differences(found))
        if options.allow_mixed:
            result.warnings.append(f"devices are not homogeneous (allowed by --allow-mixed): {text}")
        else:
            result.failures.append(f"devices are not homogeneous: {text}. {HETEROGENEOUS_ADVICE}")
