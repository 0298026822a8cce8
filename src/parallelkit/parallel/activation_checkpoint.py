"""Activation checkpointing: the blocks (fsdp units) whose activations backward recomputes."""

from __future__ import annotations

from torch import nn

from parallelkit.compat import composable_checkpoint
from parallelkit.errors import PlanError
from parallelkit.parallel.fsdp import Unit


def checkpointed_modules(units: list[Unit], policy: str | int) -> list[nn.Module]:
    """The modules activation checkpointing recomputes in backward: the model's blocks (its fsdp units).

    `policy`: "none", "full" (every block) or an int n (every n-th block: a memory/compute trade-off).
    """
    match policy:
        case "none" | 0:
            return []
        case "full":
            every = 1
        case int() if policy > 0:
            every = policy
        case _:
            raise PlanError(
                f"activation_checkpointing={policy!r}: use 'none', 'full', or a positive int n to checkpoint "
                "every n-th block."
            )
    return [
        module
        for index, unit in enumerate(units)
        if index % every == 0
        for module in (unit if isinstance(unit, list) else [unit])
    ]


def apply_activation_checkpointing(units: list[Unit], policy: str | int) -> None:
    """Recompute activations in backward for the blocks `checkpointed_modules` picks, with torch's composable
    checkpoint, so parameter names (FQNs), and so checkpoints, stay unchanged."""
    for module in checkpointed_modules(units, policy):
        composable_checkpoint(module)
