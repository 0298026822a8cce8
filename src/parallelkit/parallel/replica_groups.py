"""Replica groups: data parallelism across separately launched groups of processes, through torchft.

Each replica group is a job of its own (its own launch, its own process group and mesh inside it, e.g.
`[[2], ["fsdp"]]`); the groups hold the same model and take different rows of the data. What crosses groups goes
through torchft's `Manager` only: every optimizer step starts with a quorum (which groups take part, asked of the
lighthouse), the gradients each rank holds are averaged with the same rank of every other participating group, and
the optimizer steps only when the step commits (every participating group finished it). torchft drops a group
that stops answering from the next quorum and lets one that comes back copy a healthy peer's state.

A group joins with its first quorum (`ReplicaGroup.join`), as its run starts or resumes from a checkpoint: one
that comes back after the others went on copies a healthy one's model, buffers, optimizers and training position
(loops, schedulers, data position, RNG: `GroupState`) there and continues with them from the same step and batch. A
step that a group's failure breaks is tried again on the same micro-batches with the groups left (`CommitGate`); a
group that alone failed to commit a step the others committed copies their state in place as it tries again, which
is the state it would have had (`ReplicaGroup.retry`). Each step's groups, committed steps and tries are logged.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch

from parallelkit.compat import local_shard
from parallelkit.errors import ConfigError, ReplicaGroupError
from parallelkit.parallel.group_reduce import OverlappedReduce, flat_all_reduce, reduce_op
from parallelkit.parallel.group_state import GroupState

MAX_RETRIES = 10
"""How many times in a row a step that fails to commit is tried again before the run fails."""

LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"
"""The environment variable torchft reads the lighthouse's address from when none is given."""


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
        overlap: Start each FSDP2 unit's cross-group all-reduce as backward produces its gradients (False: one flat
            all-reduce after backward). Layouts without FSDP (DDP, tp alone) always take the flat one.
        timeout: Seconds a cross-group all-reduce or commit may take before the step fails.
        quorum_timeout: Seconds the groups may take to agree on a quorum.
        hostname: The name other groups reach this group's rank 0 by (default: this machine's).
    """

    group: int
    num_groups: int
    lighthouse: str | None = None
    min_groups: int = 1
    overlap: bool = True
    timeout: float = 60.0
    quorum_timeout: float = 60.0
    hostname: str | None = None

    @property
    def lighthouse_address(self) -> str | None:
        return self.lighthouse or os.environ.get(LIGHTHOUSE_VARIABLE)

    def check(self, mesh: Any) -> None:
        """Refuse, before launch, what cannot work with this group's `mesh` (a `MeshSpec`; None for DDP): raises
        ConfigError naming the field and the fix."""
        if mesh is not None and mesh.size("replicate") > 1:
            raise ConfigError(
                f"replica_groups with mesh_shape {mesh}: the groups are the replicated axis, so a group's mesh has no "
                "replicate axis of its own. Fix: each group's mesh without it (fsdp, pp, cp, ep, tp), e.g. "
                '[[2], ["fsdp"]], and one group per replica: replica_groups.num_groups = the replicate size.'
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
    """This rank's part in the replica groups: torchft's `Manager` over a gloo process group across the groups (this
    rank and the same rank of every other group). The first quorum is the group's `join`, as its run starts or
    resumes; then each optimizer step asks for one as it starts (`start_step`), averages the gradients across the
    step's groups (`average_gradients`) and steps only if the step commits (`should_commit`). The quorums are
    synchronous: a group that comes back copies a peer's state (`GroupState`) before its first forward."""

    def __init__(self, config: ReplicaGroups, rank: int, world_size: int, state: GroupState) -> None:
        from torchft.manager import Manager

        self.config, self.state = config, state
        timeout = timedelta(seconds=config.timeout)
        self.process_group = _quorum_process_group(timeout)
        self.manager = Manager(
            pg=self.process_group,
            load_state_dict=state.load_state_dict,
            state_dict=state.state_dict,
            min_replica_size=config.min_groups,
            use_async_quorum=False,
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
        self.overlapped: OverlappedReduce | None = None
        self.gradient_op = "mean"  # this step's reduction of the gradients: "sum" for a token step
        self.committed: bool | None = None
        self.retries = 0  # steps tried again since the run started
        self.copied_steps = 0  # committed steps the join copied from another group instead of training them
        self._quorum_ready = False  # the join's quorum is the first step's
        self._layouts_checked = False

    def join(self, step: int, batches_committed: int, position: dict[str, Any]) -> dict[str, Any] | None:
        """The group's first quorum, as its run starts at committed `step` (0, or a durable checkpoint's) with the
        training `position` it would send a group further behind. A group behind the others copies the state of
        one of them here: its model and optimizers are theirs on return, and the training position copied is
        returned (None if the group was not behind).

        A job's first step (every group of the quorum at committed step 0) waits for all `num_groups` groups, up to
        `quorum_timeout` seconds: groups launched seconds apart start together instead of the first training alone
        (`min_groups` only lets later steps commit without the groups that failed). A group that finds no other there
        (not started, or the job finished before it was relaunched) stops, saying so."""
        self.manager.load_state_dict({"step": step, "batches_committed": batches_committed})
        self.state.position = position
        deadline, tries = time.monotonic() + self.config.quorum_timeout, 0
        while True:
            try:
                self.manager.start_quorum()
            except TimeoutError as err:  # the lighthouse waits for groups of its last quorum, which are gone
                if step == 0:
                    raise self.missing_at_start([]) from err
                raise ReplicaGroupError(
                    f"replica group {self.config.group} found no quorum within quorum_timeout="
                    f"{self.config.quorum_timeout:g} s as it resumed at step {step}: the lighthouse waits for the "
                    "groups of its last quorum, which neither came nor were dropped. Fix: relaunch the other groups "
                    "too (from their last checkpoints), or restart the lighthouse."
                ) from err
            self._check_quorum()
            if self.manager.errored() is not None:
                tries += 1
                if tries > MAX_RETRIES:
                    raise self.failure(f"could not join the others at step {step}")
                continue
            if self.manager.current_step() > 0 or len(set(self.groups)) == self.config.num_groups:
                break
            if time.monotonic() > deadline:
                raise self.missing_at_start(sorted(set(self.groups)))
            time.sleep(0.2)  # and ask again: the others' first quorum requests come as they start
        self._quorum_ready, self._layouts_checked = True, False
        healed, self.state.healed = self.state.healed, None
        self.copied_steps = self.manager.current_step() - step if healed is not None else 0
        return healed

    def start_step(self, position: dict[str, Any]) -> None:
        """Ask for this step's quorum (the join's, for the first step), `position` being where the training stands:
        what a group that joins in this quorum copies with the model."""
        self.state.position = position
        if self._quorum_ready:
            self._quorum_ready = False
        else:
            self.manager.start_quorum()
            self._check_quorum()
            if self.state.healed is not None:
                raise ReplicaGroupError(
                    f"replica group {self.config.group} fell behind the others between steps: they committed step "
                    f"{position.get('global_step')} without it (it asked for the step's quorum after the lighthouse's "
                    "join timeout) and have copied their state to it, but its loops are a step behind. Fix: restart "
                    "this group (it copies their state and position as it joins); a group that stalls for that long "
                    "needs a longer `parallelkit lighthouse --join-timeout-ms`."
                )
        if not self._layouts_checked:
            self._check_layouts()

    def overlap(self) -> None:
        """Reduce the (FSDP2-sharded) trained parameters' gradients unit by unit during backward
        (`OverlappedReduce`)."""
        parameters = list(self.state.parameters.values())
        self.overlapped = OverlappedReduce(self.manager, parameters, lambda: self.gradient_op)

    @property
    def groups(self) -> tuple[int, ...]:
        """The groups of the current quorum."""
        return self.process_group.groups

    def _check_quorum(self) -> None:
        """Refuse a quorum that holds one group twice (two launches given the same group) or a group beyond
        num_groups (launched with another num_groups)."""
        groups, num_groups = self.groups, self.config.num_groups
        twice = sorted({g for g in groups if groups.count(g) > 1})
        beyond = sorted(g for g in groups if g >= num_groups)
        if twice or beyond:
            problem = (
                f"group {twice[0]} is in the quorum twice: two launches were given replica_groups.group={twice[0]}"
                if twice
                else f"group {beyond[0]} is in the quorum, but replica_groups.num_groups={num_groups} here"
            )
            raise ReplicaGroupError(
                f"replica groups {list(groups)} in this step's quorum: {problem}, and the groups would train the "
                f"same rows. Fix: launch group i of n with replica_groups.group=i and replica_groups.num_groups=n, "
                "each index once."
            )
        if self.process_group.reconfigured:
            self._layouts_checked = False

    def _check_layouts(self) -> None:
        """Refuse, as each new quorum's first step starts, groups whose layouts differ (their gradients' shards
        would not match): a fingerprint of this group's summed with the others'."""
        fingerprint = int(hashlib.sha256(self.state.layout.encode()).hexdigest()[:6], 16)
        sums = torch.tensor([fingerprint, fingerprint**2], dtype=torch.float64)
        self.manager.allreduce(sums, reduce_op=reduce_op("sum")).wait()
        if self.manager.errored() is not None:
            return  # this step fails; the next quorum checks again
        count = self.manager.num_participants()
        if sums.tolist() != [count * fingerprint, count * fingerprint**2]:
            raise ReplicaGroupError(
                f"replica groups {list(self.groups)}: not every group of this quorum has this group's layout "
                f"({self.state.layout}), so their gradients' shards do not match. Fix: launch every group with the "
                "same mesh_shape, devices and model."
            )
        self.process_group.reconfigured, self._layouts_checked = False, True

    def average_gradients(self) -> None:
        """Average (or, for token batches whose loss each group divides by the whole quorum's target count, sum:
        `gradient_op`) each local gradient (a DTensor's shard) with the same rank's of every group of the step: what
        the overlapped reduction sent during backward, waited for; the rest in one flat all-reduce. In fp32 whatever
        the gradients' dtype: nothing is summed in bf16."""
        parameters = self.state.parameters.values()
        if self.overlapped is not None:
            rest = self.overlapped.finish(parameters)
        else:
            rest = [local_shard(p.grad) for p in parameters if p.grad is not None]
        flat_all_reduce(self.manager, rest, self.gradient_op)

    def reduce(self, value: torch.Tensor, op: Any) -> torch.Tensor:
        """A logged value of this group (reduced over its own ranks) reduced across the step's groups as well:
        averaged for "mean", in fp32."""
        flat = value.detach().float().reshape(-1).clone()
        self.manager.allreduce(flat, reduce_op=reduce_op(op)).wait()
        return flat.view_as(value).to(value.dtype)

    def should_commit(self) -> bool:
        self.committed = self.manager.should_commit()
        return self.committed

    def retry(self, step: int) -> bool:
        """Start the next try of a step that did not commit (Lightning's `step`): a new quorum, without the groups
        that failed. True when this group alone failed it and the others committed it: the quorum is then their next
        step's, and this group has copied their state in it (`GroupState`), which is what committing the step would
        have left it with (parameters, buffers, optimizers; its loops and data position are theirs already, as the
        step ends). That quorum is its next step's too."""
        self.retries += 1
        before = self.manager.current_step()
        self.manager.start_quorum()
        self._check_quorum()
        healed, self.state.healed = self.state.healed, None
        if healed is None:
            if not self._layouts_checked:
                self._check_layouts()
            return False
        ahead = self.manager.current_step() - before
        if ahead != 1 or healed.get("global_step") != step + 1:
            raise ReplicaGroupError(
                f"replica group {self.config.group} fell behind the others during step {step}: they are "
                f"{ahead} committed steps ahead (at Lightning's step {healed.get('global_step')}), more than the step "
                "it was training, so their state is not where this step ends. Fix: restart this group: as it starts "
                "it copies the others' state, training position included, and continues with them."
            )
        self.copied_steps += 1
        self._quorum_ready = True
        return True

    @property
    def committed_steps(self) -> int:
        return self.manager.current_step()

    def metrics(self) -> dict[str, float]:
        """What the monitors log each step: the groups of the quorum (`ft/groups`, one bit each), how many took part,
        the committed steps, whether this one committed, the tries again so far, the steps copied (at the join or
        healing in place), and the fraction of the gradients reduced across groups during backward."""
        return {
            "ft/participants": float(self.manager.num_participants()),
            "ft/groups": float(sum(1 << g for g in set(self.groups))),
            "ft/committed_steps": float(self.manager.current_step()),
            "ft/committed": float(bool(self.committed)),
            "ft/retries": float(self.retries),
            "ft/copied_steps": float(self.copied_steps),
            "ft/overlapped": self.overlapped.fraction if self.overlapped is not None else 0.0,
        }

    def missing_at_start(self, present: list[int]) -> ReplicaGroupError:
        missing = sorted(set(range(self.config.num_groups)) - set(present) - {self.config.group})
        return ReplicaGroupError(
            f"replica group {self.config.group}: the job's first step waits for all {self.config.num_groups} groups, "
            f"and groups {missing} did not join within quorum_timeout={self.config.quorum_timeout:g} s (at step 0: "
            f"{present or [self.config.group]}). Either they are not started yet, or the job already finished "
            "and this group was launched again after the others ended: no group is left to copy the trained state "
            "from, and training alone from step 0 would give other weights. Fix: launch every group (each waits for "
            "the others, up to replica_groups.quorum_timeout); for a finished job, use its final checkpoints."
        )

    def failure(self, what: str) -> ReplicaGroupError:
        return ReplicaGroupError(
            f"replica group {self.config.group} {what}: {MAX_RETRIES + 1} tries in a row failed (a group failing in "
            f"each, or fewer than min_groups={self.config.min_groups} groups left). Fix: the groups' and the "
            "lighthouse's logs say which failed; relaunch this group (it rejoins the others) or all of them from the "
            "last checkpoint."
        )

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


class CommitGate:
    """The optimizer as Lightning's loop steps it, under replica groups: `step(closure)` runs the closure (the last
    micro-batch's forward and backward, the gradients averaged across groups, clipping) and steps the optimizer only
    if the step commits. `replay` runs the step's earlier micro-batches again before a retry (their gradients anew),
    `step_index` is Lightning's step."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: ReplicaGroup, replay: Any, step_index: int) -> None:
        self.optimizer, self.group, self.replay, self.step_index = optimizer, group, replay, step_index

    def step(self, closure: Any = None) -> Any:
        """A step that does not commit (a group failed during it) is tried again on the same micro-batches, with the
        groups of a new quorum: Lightning's step count, the learning-rate schedule and the data position only move
        on a committed step. A group that alone failed it heals in place instead (`ReplicaGroup.retry`). Up to
        `MAX_RETRIES` tries in a row, then the run fails naming the step."""
        for attempt in range(MAX_RETRIES + 1):
            if attempt:
                self.replay()
            result = closure() if closure is not None else None
            if self.group.should_commit():
                self.optimizer.step()
                return result
            if self.group.retry(self.step_index):
                return result
        raise self.group.failure(f"could not commit the step after committed step {self.group.committed_steps}")

    def __getattr__(self, name: str) -> Any:  # param_groups, state, zero_grad, ...: the optimizer's
        return getattr(self.optimizer, name)


def _quorum_process_group(timeout: timedelta) -> Any:
    """torchft's gloo process group across the groups, noting at each reconfiguration (a new quorum) which groups
    it spans (`groups`; torchft numbers a group's ranks after its index)."""
    from torchft.process_group import ProcessGroupGloo

    class QuorumProcessGroup(ProcessGroupGloo):
        groups: tuple[int, ...] = ()
        reconfigured = False

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, *args: Any, **kwargs: Any):
            ranks = kwargs.get("global_ranks", args[3] if len(args) > 3 else None) or []
            size = kwargs.get("group_world_size", args[2] if len(args) > 2 else None) or 1
            self.groups, self.reconfigured = tuple(r // size for r in ranks), True
            super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)

    return QuorumProcessGroup(timeout=timeout)
