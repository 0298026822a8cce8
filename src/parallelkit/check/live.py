"""The launched half of `parallelkit check`: every rank of the run's own mesh reports itself, then times collectives
over each mesh axis, each with a deadline.

Before any process group exists, the ranks meet on a TCPStore (MASTER_ADDR:MASTER_PORT, as `fit` would) with a
deadline: rank 0 names the ranks that never arrive. The store then stays the side channel of the check: before each
collective a rank writes where it is (`at/<rank>`), and a rank whose collective times out writes what it waited for
(`failed/<rank>`), so rank 0 can name the rank that stopped answering, and in which call, even when that rank is
still alive and silent.

Bandwidths follow nccl-tests' definitions (its doc/PERFORMANCE.md): for a collective over n ranks on a buffer of S
bytes taking t seconds, algbw = S / t and busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather,
reduce-scatter and all-to-all (S their whole buffer: all-gather's output, reduce-scatter's input), x 1 for
send/recv; a group's time is its slowest rank's.

Over 400 lines: the rank report, the groups, the timed collectives, the store's side channel and the verdict are one
protocol every rank runs in step, each part written against the others' keys and order.
"""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import product
from typing import Any

import torch
import torch.distributed as dist

import parallelkit
from parallelkit.errors import ParallelkitError
from parallelkit.mesh import MeshSpec

BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}
"""nccl-tests' bus bandwidth factor per collective, for a group of n ranks."""

ENV_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_DEBUG",
    "GLOO_SOCKET_IFNAME",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
)
"""Launcher and communication variables that change what a job's collectives do (printed when set)."""

COMPARED = ("device", "capability", "device_memory", "torch", "cuda", "nccl", "driver", "python", "parallelkit")
"""What every rank must agree on (a mixed cluster is refused unless `--allow-mixed`)."""

HETEROGENEOUS_ADVICE = (
    "Ranks of one job should run the same device type, memory and software: a slower or smaller device paces "
    "every collective and sets the memory limit of the whole layout, and different torch/NCCL builds can disagree "
    "on the wire. Fix: schedule the job on identical nodes (a SLURM constraint or partition of one GPU type) with one "
    "software image, or pass --allow-mixed if the mix is intended."
)


@dataclass
class Options:
    deadline: float = 60.0  # seconds a collective may take
    join_deadline: float = 300.0  # seconds the ranks may take to start and meet
    sizes: tuple[int, ...] = (64 * 2**10, 2**20, 16 * 2**20)
    iters: int = 5
    allow_mixed: bool = False
    json: bool = False


@dataclass
class Measurement:
    """One collective at one size on one axis: every group of the axis ran it at once."""

    axis: str
    op: str
    size: int
    group_size: int
    seconds: dict[tuple[int, ...], float] = field(default_factory=dict)  # group ranks -> its slowest rank's time

    def busbw(self, group: tuple[int, ...]) -> float:
        return self.size / self.seconds[group] * BUS_FACTOR[self.op](self.group_size)

    @property
    def slowest(self) -> tuple[int, ...]:
        return max(self.seconds, key=self.seconds.get)

    def as_dict(self) -> dict[str, Any]:
        slow = self.slowest
        return {
            "axis": self.axis,
            "op": self.op,
            "bytes": self.size,
            "group_size": self.group_size,
            "latency_us": self.seconds[slow] * 1e6,
            "algbw_gbps": self.size / self.seconds[slow] / 1e9,
            "busbw_gbps": self.busbw(slow) / 1e9,
            "slowest_group": list(slow),
            "groups": {",".join(map(str, g)): s * 1e6 for g, s in self.seconds.items()},
        }


# -- what a rank reports ------------------------------------------------------------------------------------------
def launcher_name() -> str:
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    if os.environ.get("SLURM_JOB_ID"):
        return "slurm"
    return "lightning"


def rank_report(rank: int, device: torch.device) -> dict[str, Any]:
    """What this rank runs on: host, device, versions, launcher and the communication environment."""
    cuda = device.type == "cuda"
    props = torch.cuda.get_device_properties(device) if cuda else None
    driver = "-"
    if cuda and os.path.exists("/proc/driver/nvidia/version"):
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
        driver = next((w for w in words if w[:1].isdigit() and "." in w), "-")
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": props.name if props else f"cpu ({platform.machine()})",
        "capability": f"{props.major}.{props.minor}" if props else "-",
        "device_memory": props.total_memory if props else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "-",
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-",
        "driver": driver,
        "python": platform.python_version(),
        "parallelkit": parallelkit.__version__,
        "launcher": launcher_name(),
        "env": {name: os.environ[name] for name in ENV_VARS if name in os.environ},
    }


def differences(reports: Sequence[dict[str, Any]]) -> dict[str, dict[Any, list[int]]]:
    """For each compared field on which the ranks disagree: value -> the ranks reporting it."""
    found: dict[str, dict[Any, list[int]]] = {}
    for key in COMPARED:
        values: dict[Any, list[int]] = {}
        for report in reports:
            values.setdefault(report[key], []).append(report["rank"])
        if len(values) > 1:
            found[key] = values
    return found


def describe_differences(found: dict[str, dict[Any, list[int]]]) -> list[str]:
    lines = []
    for key, values in found.items():
        common = max(values, key=lambda v: len(values[v]))
        odd = "; ".join(
            f"{'rank' if len(r) == 1 else 'ranks'} {_ranks(r)} {'reports' if len(r) == 1 else 'report'} {v!r}"
            for v, r in values.items()
            if v != common
        )
        lines.append(f"{key}: {odd}, where the other ranks report {common!r}")
    return lines


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


# -- the mesh's groups --------------------------------------------------------------------------------------------
def axis_groups(spec: MeshSpec, axis: str) -> list[tuple[int, ...]]:
    """Every group of `axis`: the ranks that share their coordinates on every other axis, in rank order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(spec.world_size):
        coords = spec.coordinates(rank)
        groups.setdefault(tuple(v for k, v in coords.items() if k != axis), []).append(rank)
    return [tuple(g) for g in groups.values()]


def ops_of(axis: str) -> tuple[str, ...]:
    """The collectives training runs over an axis: point-to-point between stages on pp, all-to-all on ep too."""
    if axis == "pp":
        return ("send_recv",)
    if axis == "ep":
        return ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    return ("all_reduce", "all_gather", "reduce_scatter")


def run_collective(op: str, size: int, group: Any, ranks: tuple[int, ...], rank: int, device: torch.device) -> None:
    """One `op` on a buffer of `size` bytes (nccl-tests' S) over `group`, this rank's part of it."""
    n = len(ranks)
    whole = torch.ones(size // 4, device=device)
    part = torch.empty(size // 4 // n, device=device)
    if op == "all_reduce":
        dist.all_reduce(whole, group=group)
    elif op == "all_gather":
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(
            whole, part, group=group
        )  # new name, torch 2.13
    elif op == "reduce_scatter":
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(part, whole, group=group)
    elif op == "all_to_all":
        dist.all_to_all_single(torch.empty_like(whole), whole, group=group)
    elif op == "send_recv":  # a ring over the stages: each sends to the next and receives from the previous
        here = ranks.index(rank)
        ops = [
            dist.P2POp(dist.isend, whole, ranks[(here + 1) % n], group),
            dist.P2POp(dist.irecv, torch.empty_like(whole), ranks[(here - 1) % n], group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    else:
        raise ValueError(op)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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

    def wait_for(self, prefix: str, seconds: float) -> list[int]:
        """Wait up to `seconds` for every rank's `prefix/<rank>` key; returns the ranks still missing."""
        end = time.monotonic() + seconds
        while True:
            missing = [r for r in range(self.world) if r not in self.present(prefix)]
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
        missing = board.wait_for("joined", options.join_deadline)
        if missing:
            board.put("verdict", {"go": False})
            result.failures.append(
                f"rank {_ranks(missing)} never joined: {world - len(missing)} of {world} ranks reached rank 0 within "
                f"the deadline of {options.join_deadline:g} s (--join-deadline). Check that process started (its "
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


def size_text(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} B"
