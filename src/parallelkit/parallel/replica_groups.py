"""Replica groups: data parallelism across separately launched groups of processes, through torchft.

Each replica group is a job of its own (its own launch, its own process group and mesh inside it, e.g.
`[[2], ["fsdp"]]`); the groups hold the same model and take different rows of the data. What crosses groups goes
through torchft's `Manager` only: every optimizer step starts with a quorum (which groups take part, asked of the
lighthouse), the gradients each rank holds are averaged with the same rank of every other participating group, and
the optimizer steps only when the step commits (every participating group finished it). torchft drops a group
that stops answering from the next quorum and lets one that comes back copy a healthy peer's state.

What works today: the groups train as one data-parallel job, equal to one process (fp32) when none fails; a group
that dies leaves the others training, a step it broke tried again on the same batch (`CommitGate`); each step's
quorum size, committed steps and retries are logged. What does not yet: a group that comes back copies the model and
optimizer (torchft's heal, untested here) but not Lightning's step count or data position.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
from torch.distributed.tensor import DTensor

from parallelkit.errors import ConfigError, ParallelkitError

MAX_RETRIES = 10
"""How many times in a row a step that fails to commit is tried again before the run fails."""

LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"
"""The environment variable torchft reads the lighthouse's address from when none is given."""


class ReplicaGroupError(ParallelkitError):
    """A replica group cannot go on: its step keeps failing to commit."""


@dataclass(frozen=True)
class ReplicaGroups:
    """Fault-tolerant data parallelism across replica groups launched separately (torchft: `pip install
    'parallelkit[ft]'`).

    Args:
        group: This group's index, 0 to num_groups - 1: which share of each global batch it trains.
        num_groups: The groups of the whole job; the global batch is divided among them.
        lighthouse: The lighthouse's address (`http://HOST:PORT`, from `parallelkit lighthouse`); default:
            $TORCHFT_LIGHTHOUSE.
        min_groups: The fewest groups a step commits with.
        timeout: Seconds a cross-group all-reduce or commit may take before the step fails.
        quorum_timeout: Seconds the groups may take to agree on a quorum.
        hostname: The name other groups reach this group's rank 0 by (default: this machine's).
    """

    group: int
    num_groups: int
    lighthouse: str | None = None
    min_groups: int = 1
    timeout: float = 60.0
    quorum_timeout: float = 60.0
    hostname: str | None = None

    @property
    def lighthouse_address(self) -> str | None:
        return self.lighthouse or os.environ.get(LIGHTHOUSE_VARIABLE)

    def check(self, mesh: Any) -> None:
        """Refuse, before launch, what cannot work with this group's `mesh` (a `MeshSpec`): raises ConfigError
        naming the field and the fix."""
        if mesh.size("replicate") > 1 or mesh.size("pp") > 1 or mesh.cp_size > 1:
            raise ConfigError(
                f"replica_groups with mesh_shape {mesh}: the groups are the replicated axis, so a group's mesh has no "
                "replicate axis; pipelines and cp under replica groups are not done yet. Fix: a mesh of fsdp, ep "
                'and tp inside each group, e.g. [[2], ["fsdp"]].'
            )
        if self.num_groups < 1 or not 0 <= self.group < self.num_groups:
            raise ConfigError(
                f"replica_groups.group={self.group} with num_groups={self.num_groups}: each group's index is one of "
                f"0..num_groups-1. Fix: launch group i of n with replica_groups.group=i, replica_groups.num_groups=n."
            )
        if not 1 <= self.min_groups <= self.num_groups:
            raise ConfigError(
                f"replica_groups.min_groups={self.min_groups} with num_groups={self.num_groups}: a step commits with "
                "at least 1 group and at most all of them. Fix: e.g. min_groups=1 (train on while any group lives)."
            )
        if not self.lighthouse_address:
            raise ConfigError(
                "replica_groups has no lighthouse: give replica_groups.lighthouse=http://HOST:PORT or set "
                f"${LIGHTHOUSE_VARIABLE}. Start one with: parallelkit lighthouse --min-groups 1"
            )
        try:
            import torchft  # noqa: F401
        except ImportError as err:
            raise ConfigError(
                f"replica_groups needs torchft, which is not installed ({err}). Fix: pip install 'parallelkit[ft]'."
            ) from err
        self.check_lighthouse()

    def check_accumulation(self, accumulate_grad_batches: int) -> None:
        """Refuse gradient accumulation: a step that fails to commit is tried again on its last micro-batch only."""
        if accumulate_grad_batches > 1:
            raise ConfigError(
                f"replica_groups with trainer.accumulate_grad_batches={accumulate_grad_batches}: a step that fails to "
                "commit is tried again on its batch, which accumulation spreads over micro-batches already gone; "
                "not done yet. Fix: accumulate_grad_batches=1 with a larger data.batch_size, or more groups."
            )

    def check_lighthouse(self) -> None:
        """Refuse a lighthouse address nothing answers at within `timeout` (a TCP connection; torchft's manager
        would fail inside the first rank's setup, the other ranks then failing in C++)."""
        address = self.lighthouse_address
        url = urlsplit(address if "://" in address else f"http://{address}")
        try:
            host, port = url.hostname, url.port
        except ValueError:
            host = port = None
        if not host or not port:
            raise ConfigError(
                f"replica_groups.lighthouse={address!r} is not an address: give http://HOST:PORT, as `parallelkit "
                "lighthouse` prints it."
            )
        try:
            socket.create_connection((host, port), timeout=self.timeout).close()
        except OSError as err:
            raise ConfigError(
                f"replica_groups.lighthouse={address}: nothing answers there within {self.timeout:g} s ({err}). Fix: "
                f"start it first (parallelkit lighthouse --port {port}), or give the address it printed."
            ) from err


class ReplicaGroup:
    """This rank's part in the replica groups: torchft's `Manager` for the process group inside this group (built
    once that exists), asked for a quorum at each optimizer step's start (`start_step`), for the average of the
    gradients across groups (`average_gradients`) and for whether the step commits (`should_commit`)."""

    def __init__(
        self, config: ReplicaGroups, rank: int, world_size: int, state: Any, parameters: list[torch.nn.Parameter]
    ) -> None:
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        self.config = config
        self.parameters = parameters  # those trained: their gradients are averaged across groups
        timeout = timedelta(seconds=config.timeout)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=state.load_state_dict,
            state_dict=state.state_dict,
            min_replica_size=config.min_groups,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout),
            connect_timeout=timeout,
            rank=rank,
            world_size=world_size,
            lighthouse_addr=config.lighthouse_address,
            replica_id=f"parallelkit_group_{config.group}",
            hostname=config.hostname or socket.gethostname(),
            init_sync=False,  # every group draws the same weights from the seed
        )
        self.committed: bool | None = None
        self.retries = 0  # steps tried again since the run started

    def start_step(self) -> None:
        self.manager.start_quorum()

    def average_gradients(self) -> None:
        """Average each local gradient (a DTensor's shard) with the same rank's of every participating group: one
        flat fp32 all-reduce (whatever the gradients' dtype, nothing is summed in bf16)."""
        grads = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.parameters if p.grad is not None
        ]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        self.manager.allreduce(flat).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def should_commit(self) -> bool:
        self.committed = self.manager.should_commit()
        return self.committed

    def retry(self) -> None:
        """Start the next try of a step that did not commit: a new quorum, without the groups that failed."""
        self.retries += 1
        self.manager.start_quorum()

    @property
    def committed_steps(self) -> int:
        return self.manager.current_step()

    def metrics(self) -> dict[str, float]:
        """What the monitors log each step: the groups in the quorum, the committed steps, whether this one did."""
        return {
            "ft/participants": float(self.manager.num_participants()),
            "ft/committed_steps": float(self.manager.current_step()),
            "ft/committed": float(bool(self.committed)),
            "ft/retries": float(self.retries),
        }

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


class CommitGate:
    """The optimizer as Lightning's loop steps it, under replica groups: `step(closure)` runs the closure (forward,
    backward, the gradients averaged across groups, clipping) and steps the optimizer only if the step commits."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: ReplicaGroup) -> None:
        self.optimizer = optimizer
        self.group = group

    def step(self, closure: Any = None) -> Any:
        """A step that does not commit (a group failed during it) is tried again on the same batch, with the groups
        of a new quorum: Lightning's step count, the learning-rate schedule and the data position only move on a
        committed step. Up to `MAX_RETRIES` tries in a row, then the run fails naming the step."""
        for _ in range(MAX_RETRIES + 1):
            result = closure() if closure is not None else None
            if self.group.should_commit():
                self.optimizer.step()
                return result
            self.group.retry()
        raise ReplicaGroupError(
            f"replica group {self.group.config.group}: the step after committed step {self.group.committed_steps} "
            f"failed to commit {MAX_RETRIES + 1} times in a row (a group failing in each try, or fewer than "
            f"min_groups={self.group.config.min_groups} groups left). Fix: the groups' and the lighthouse's logs say "
            "which failed; relaunch from the last checkpoint."
        )

    def __getattr__(self, name: str) -> Any:  # param_groups, state, zero_grad, ...: the optimizer's
        return getattr(self.optimizer, name)
