"""`parallelkit.parallel.schedule`: pipeline schedules' placement, defaults and checks, as pure arithmetic."""

import pytest

from parallelkit.errors import ConfigError
from parallelkit.parallel.schedule import SCHEDULES, Schedule


def test_loop_placement_gives_rank_r_every_pp_th_stage_and_v_placement_folds_back():
    assert [Schedule("1f1b", 4).stage_indices(r) for r in range(4)] == [[0], [1], [2], [3]]
    assert [Schedule("interleaved_1f1b", 2, 3).stage_indices(r) for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    assert [Schedule("zbv", 3).stage_indices(r) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    # The last stage's rank: the end of the loop, or the V's turn back to rank 0.
    assert Schedule("interleaved_1f1b", 4).last_stage_rank() == 3
    assert Schedule("dualpipev", 4).last_stage_rank() == 0


@pytest.mark.parametrize(
    ("name", "stages_per_rank", "microbatches"),
    [("gpipe", 1, 8), ("1f1b", 1, 8), ("interleaved_1f1b", 2, 16), ("looped_bfs", 2, 16), ("zbv", 2, 16)],
)
def test_defaults_are_two_microbatches_per_stage(name, stages_per_rank, microbatches):
    schedule = Schedule(name, pp=4)
    assert (schedule.stages_per_rank, schedule.num_stages, schedule.microbatches) == (
        stages_per_rank,
        4 * stages_per_rank,
        microbatches,
    )
    assert Schedule(name, 4, given_microbatches=12).microbatches == 12
    assert schedule.torch_class == SCHEDULES[name]


def test_ideal_bubble_of_each_family():
    assert Schedule("1f1b", 4, given_microbatches=8).theoretical_bubble == pytest.approx(3 / 11)
    assert Schedule("interleaved_1f1b", 4, 2, 8).theoretical_bubble == pytest.approx(3 / 19)
    assert Schedule("interleaved_zero_bubble", 4, 2, 8).theoretical_bubble == pytest.approx(3 / 51)
    assert Schedule("zbv", 4).theoretical_bubble == 0.0
    assert Schedule("dualpipev", 4).theoretical_bubble is None


@pytest.mark.parametrize(
    ("schedule", "options", "message"),
    [
        (Schedule("chimera"), {}, "schedule='chimera' is not a pipeline schedule; use one of gpipe, 1f1b"),
        (Schedule("1F1B", given_stages_per_rank=2), {}, "stages_per_rank=2 with schedule='1f1b': single-stage"),
        (Schedule("zbv", given_stages_per_rank=3), {}, "V-shaped schedules .* place exactly 2 stages per rank"),
        (Schedule("zbv"), {"activation_checkpointing": "full"}, "recomputed twice"),
        (Schedule("dualpipev"), {"compile": True}, "torch does not do for compiled code"),
        (Schedule("gpipe", given_microbatches=0), {}, "microbatches=0: use a positive number"),
    ],
)
def test_options_a_schedule_cannot_run_are_refused_naming_the_fix(schedule, options, message):
    with pytest.raises(ConfigError, match=message):
        schedule.check_options(**options)


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (Schedule("1f1b", 1), "has pp=1; pipeline schedules need a pp axis of at least 2"),
        (Schedule("1f1b", 4, given_microbatches=2), "microbatches=2 is fewer than the 4 pipeline ranks"),
        (Schedule("interleaved_1f1b", 4, 2, 6), "needs microbatches to be a multiple of pp=4, got 6"),
        (Schedule("dualpipev", 2, given_microbatches=2), "at least as many microbatches as stages \\(4"),
    ],
)
def test_layouts_a_schedule_cannot_run_are_refused_with_the_numbers(schedule, message):
    with pytest.raises(ConfigError, match=message):
        schedule.check_layout("[[...]]")


def test_a_batch_must_split_into_the_microbatches():
    Schedule("1f1b", 2, given_microbatches=4).check_batch(8)
    with pytest.raises(ConfigError, match="microbatches=4 does not divide the per-process batch of 6"):
        Schedule("1f1b", 2, given_microbatches=4).check_batch(6)
