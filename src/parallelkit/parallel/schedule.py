"""Pipeline schedules as parallelkit names them: the table, the checks, stage placement and the ideal bubble.

Pure arithmetic (no torch, no process group), shared by `PipelineStrategy` and the planner, so both mean the same
by a schedule (its microbatch default included). The schedules themselves are torch's
(`torch.distributed.pipelining`).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallelkit.errors import ConfigError

SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
    "interleaved_zero_bubble": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
"""Schedule names users write -> torch's schedule class names."""

MULTI_STAGE = {"interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv", "dualpipev"}
"""Schedules that run several (virtual) stages per rank."""

V_SHAPED = {"zbv", "dualpipev"}
"""Schedules that place exactly two stages per rank in a V: rank r holds stages r and 2 pp - 1 - r, so the first and
the last stage share rank 0 (the others use the loop placement: rank r holds stages r, r + pp, r + 2 pp, ...)."""

ZERO_BUBBLE = {"interleaved_zero_bubble", "zbv", "dualpipev"}
"""Schedules that split each backward into an input-gradient step and a later weight-gradient step, which fills
the bubble."""


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule over `pp` ranks, with the user's `stages_per_rank` and `microbatches` (None: defaults)."""

    name: str
    pp: int = 1
    given_stages_per_rank: int | None = None
    given_microbatches: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", self.name.lower())

    @property
    def stages_per_rank(self) -> int:
        """Virtual stages per rank: as given, else 2 for interleaved schedules and 1 for the others."""
        if self.given_stages_per_rank is not None:
            return self.given_stages_per_rank
        return 2 if self.name in MULTI_STAGE else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def microbatches(self) -> int:
        """As given, else 2 x the number of stages (fewer bubbles than the minimum, one stage's worth)."""
        return self.given_microbatches or 2 * self.num_stages

    @property
    def torch_class(self) -> str:
        return SCHEDULES[self.name]

    @property
    def multi_stage(self) -> bool:
        return self.name in MULTI_STAGE

    def stage_indices(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` holds, in the order torch's schedules expect.

        Loop placement (every multi-stage schedule but the V-shaped ones): rank r holds r, r + pp, r + 2 pp, ...
        V placement: the stages go down the ranks and back up, so with pp=2 rank 0 holds 0 and 3, rank 1 holds 1 and
        2; the last stage then runs beside the first, and the turn (stages pp - 1 and pp) needs no send.
        """
        if self.name in V_SHAPED:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + i * self.pp for i in range(self.stages_per_rank)]

    def last_stage_rank(self) -> int:
        """The pipeline rank that holds the last stage (its loss)."""
        return next(rank for rank in range(self.pp) if self.num_stages - 1 in self.stage_indices(rank))

    @property
    def theoretical_bubble(self) -> float | None:
        """Idle fraction of the ideal schedule, for p ranks, v stages each, m microbatches: (p - 1) / (v m + p - 1)
        for GPipe and the 1F1B family. Zero-bubble schedules assume equal forward, input-gradient and weight-gradient
        times: ZB1P leaves a third of 1F1B's idle time, (p - 1) / (3 v m + p - 1); ZB-V none. DualPipeV's depends on
        how much of a forward overlaps a backward (the DualPipe paper's F&B): None."""
        p, v, m = self.pp, self.stages_per_rank, self.microbatches
        match self.name:
            case "interleaved_zero_bubble":
                return (p - 1) / (3 * v * m + p - 1)
            case "zbv":
                return 0.0
            case "dualpipev":
                return None
        return (p - 1) / (v * m + p - 1)

    def check_options(self, activation_checkpointing: int | str = "none", compile: bool | str = False) -> None:
        """What is wrong with the schedule's own options, and with the strategy options it cannot run with, before any
        mesh is known; raises ConfigError."""
        spr = self.given_stages_per_rank
        if self.name not in SCHEDULES:
            raise ConfigError(f"schedule={self.name!r} is not a pipeline schedule; use one of {', '.join(SCHEDULES)}.")
        if spr is not None and self.name in V_SHAPED and spr != 2:
            raise ConfigError(
                f"stages_per_rank={spr} with schedule={self.name!r}: V-shaped schedules "
                f"({', '.join(sorted(V_SHAPED))}) place exactly 2 stages per rank. Set stages_per_rank=2 (or leave "
                "it out), or use schedule='interleaved_zero_bubble' for another number."
            )
        if spr is not None and (spr < 1 or (self.name not in MULTI_STAGE and spr != 1)):
            raise ConfigError(
                f"stages_per_rank={spr} with schedule={self.name!r}: single-stage schedules "
                f"(gpipe, 1f1b) take 1; interleaved ones ({', '.join(sorted(MULTI_STAGE - V_SHAPED))}) take 1 or more."
            )
        if self.name in ZERO_BUBBLE and activation_checkpointing not in ("none", 0):
            raise ConfigError(
                f"schedule={self.name!r} with activation_checkpointing={activation_checkpointing!r}: "
                "zero-bubble schedules run each block's backward in two passes (input gradients, then weight "
                "gradients), so a checkpointed block would be recomputed twice, which torch's checkpoint cannot do "
                "(it fails in the weight pass). Set activation_checkpointing='none', or checkpoint under "
                "schedule='interleaved_1f1b' (or '1f1b')."
            )
        if self.name in ZERO_BUBBLE and compile:
            raise ConfigError(
                f"schedule={self.name!r} with compile={compile!r}: zero-bubble schedules split each block's "
                "backward into input and weight gradients, which torch does not do for compiled code. Set "
                "compile=false, or compile under schedule='interleaved_1f1b' (or '1f1b')."
            )
        if self.given_microbatches is not None and self.given_microbatches < 1:
            raise ConfigError(
                f"microbatches={self.given_microbatches}: use a positive number that divides data.batch_size."
            )

    def check_layout(self, mesh: object = None) -> None:
        """What is wrong with this schedule on `pp` ranks (`mesh`: how the mesh is written, for the message)."""
        pp, m = self.pp, self.microbatches
        if pp < 2:
            raise ConfigError(
                f"mesh_shape {mesh} has pp={pp}; pipeline schedules need a pp axis of at "
                'least 2, e.g. [[2, 2], ["pp", "fsdp"]]. For no pipeline, use strategy="fsdp_tp".'
            )
        if m < pp:
            raise ConfigError(
                f"microbatches={m} is fewer than the {pp} pipeline ranks: some stages would "
                f"idle every step. Use microbatches >= {pp} (and dividing data.batch_size)."
            )
        if self.stages_per_rank > 1 and m % pp:
            raise ConfigError(f"schedule={self.name!r} needs microbatches to be a multiple of pp={pp}, got {m}.")
        if self.name == "dualpipev" and m < self.num_stages:
            raise ConfigError(
                f"schedule='dualpipev' needs at least as many microbatches as stages ({self.num_stages}: pp="
                f"{pp} x 2), got microbatches={m}. Use microbatches >= {self.num_stages} (and dividing "
                "data.batch_size)."
            )

    def check_batch(self, batch_size: int) -> None:
        """A process's batch must split into the microbatches."""
        if batch_size % self.microbatches:
            raise ConfigError(
                f"microbatches={self.microbatches} does not divide the per-process batch of {batch_size} "
                f"(data.batch_size). Fix: a batch size that is a multiple of {self.microbatches}, or microbatches "
                "that divide it."
            )
