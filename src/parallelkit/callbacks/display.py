"""What a run prints: Lightning's rich progress bar and model summary, without the figures they get wrong here."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichModelSummary, RichProgressBar
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count
from rich.console import Console
from rich.table import Table
from typing_extensions import override


class ProgressBar(RichProgressBar):
    """Lightning's rich progress bar. A run bounded by `max_steps` has `max_epochs=-1`, which Lightning's bar shows
    as "Epoch 0/-2"; this one shows "Epoch 0" then."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            description = description.replace(f"/{self.trainer.max_epochs - 1}", "")
        return description

    @property
    @override
    def total_train_batches(self) -> int | float:
        """The epoch's batches, bounded by `max_steps` counted from the epoch's first batch: the bar counts the
        batch index in the epoch, which a resumed run continues, while Lightning bounds it by the steps left from
        where the run started (a run resumed at step 51 of 200 showed 200/149) and counts them as batches (a bar of
        steps, not batches, under gradient accumulation)."""
        trainer = self.trainer
        total = trainer.num_training_batches
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
            accumulate = trainer.accumulate_grad_batches
            done = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # this epoch's, the resumed included
            total = min(total, done - done % accumulate + (trainer.max_steps - trainer.global_step) * accumulate)
        return total

    @override
    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        # The logger's version, which the rich bar formats as a float ("v_num: 0.000"): the run's directory says it.
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics


class ModelSummary(RichModelSummary):
    """Lightning's rich model summary, without its FLOPs column and total when they were not measured (Lightning
    counts them only for a model with an `example_input_array`, and prints 0 otherwise)."""

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            RichModelSummary.summarize(
                summary_data,
                total_parameters,
                trainable_parameters,
                model_size,
                total_training_modes,
                total_flops,
                **summarize_kwargs,
            )
            return
        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(name, justify="left" if name in ("Name", "Type", "Mode") else "right")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        totals = Table.grid()
        for label, value in (
            ("Trainable params", get_human_readable_count(trainable_parameters)),
            ("Non-trainable params", get_human_readable_count(total_parameters - trainable_parameters)),
            ("Total params", get_human_readable_count(total_parameters)),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", str(total_training_modes["train"])),
            ("Modules in eval mode", str(total_training_modes["eval"])),
        ):
            totals.add_row(f"[bold]{label}[/]: {value}")
        console = Console()
        console.print(table)
        console.print(totals)
