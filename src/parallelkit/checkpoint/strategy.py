"""How a parallelkit strategy saves and loads checkpoints: sharded (DCP) or one file, atomic, layout-independent.

`ShardedCheckpoints` is mixed into `ParallelkitStrategy` ahead of Lightning's `ModelParallelStrategy`, whose
checkpoint methods it overrides; the strategy keeps the Lightning lifecycle, this keeps the I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from typing_extensions import override

from parallelkit.adapters.lora import has_adapters, trainable_names
from parallelkit.checkpoint import (
    check_compatible,
    load_meta,
    load_sharded,
    publish,
    read_metadata,
    remove,
    staging_path,
)
from parallelkit.compat import attached_trainer, logging_a_step

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
"""Optimizer state keyed per parameter name (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`): each rank saves
only its own parameters' entries, so a checkpoint loads under any layout. Unflattened, `param_groups` is one
list that DCP keeps from rank 0 only, and a pipeline stage 1 loading it finds none of its parameters."""


class ShardedCheckpoints:
    """Checkpoint I/O of a parallelkit strategy (see the module's docstring); its methods are Lightning strategy
    methods and hooks, reached through the strategy."""

    EXTRA_STATE_KEY = "strategy"
    """The DCP key that `extra_state()` is saved under: its entries appear as `strategy.<key>` in a checkpoint."""

    def extra_state(self) -> dict[str, Any]:
        """The strategy's own training state, to checkpoint next to the model and optimizers (default: none).

        A flat mapping of key -> tensor, DTensor, or small picklable value, asked of every rank when a full
        checkpoint is saved (not a weights-only one) and written through DCP with the model: each rank writes its
        DTensors' shards, and a key that several ranks give (a replicated tensor, the same shard) is written once, by
        one of them. So ranks whose values differ must give different keys; keys may differ from rank to rank. Key
        by parameter name, not by position, so that the state loads under another layout.
        """
        return {}

    def load_extra_state(self, read: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """Restore what `extra_state()` saved; runs after the model and optimizers are restored, so it may
        overwrite them (default: reads nothing).

        `read(template)` fills the template (key -> tensor or DTensor of the shape and layout wanted here, or any
        value standing for a non-tensor) in place from the checkpoint, resharding DTensors to the template's
        layout, and returns the entries the checkpoint held; a key it lacks (a checkpoint written by another
        strategy, or before that state existed) is left out of the result. `read` is collective: call it on every
        rank the same number of times (the templates may differ from rank to rank). Only sharded (DCP) checkpoints
        hold extra state; a single-file checkpoint does not, and this is not called for one.
        """

    async_checkpoint = False
    """Write the checkpoints saved at a step's end in the background (the strategy's `async_checkpoint`)."""

    # Rank 0's saves that wait for their step's logs and, written in the background, for their write: (staging, path,
    # write), and the removals that wait for them, (None, path, None), in the order ModelCheckpoint asked for them.
    # The first `_logged` of them belong to logged steps.
    _unpublished: tuple[tuple[Path | None, Path, Future | None], ...] = ()
    _logged = 0
    _in_flight: Future | None = None
    """This rank's background write (at most one: a save waits for the previous one)."""
    _writes_group: Any = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Save atomically: every rank writes under `<name>.partial`, and rank 0 renames it to `<name>` once all
        have finished, so a checkpoint under its final name is complete and a crash mid-save leaves the
        previous one (and `ckpt_path="last"`, which ignores `.partial`) intact.

        A checkpoint saved at the end of a training step (ModelCheckpoint's `every_n_train_steps`) is renamed only
        once Lightning has handed that step's metrics to the loggers, which it does after every batch-end hook: a run
        killed in between would otherwise leave `last` on a step its logs lack, and the relaunch would resume after
        it. So the logs of a run that survived faults have every step. The checkpoints ModelCheckpoint removes in that
        step (those the new one replaces) are removed after it is published (`remove_checkpoint`).

        "Handed to the loggers" is "on disk" here without a flush of ours: Lightning calls each logger's `save()` right
        after its `log_metrics()` (CSVLogger writes its rows then, whatever `flush_logs_every_n_steps` says; TensorBoard
        flushes its writer). A flush before the save could not help: the step's metrics are in no logger yet.

        With `async_checkpoint`, a sharded save at a step's end returns once the state is copied (staged) in memory;
        DCP writes it from a thread over a process group of its own, and rank 0 publishes it at the start of the first
        batch that finds the write complete (DCP's last collective ends every rank's write before rank 0's). One write
        is in flight at most: the next save, and every save outside a step's end (SIGTERM's, the end of fit's), waits
        for it first."""
        path = Path(self.broadcast(str(filepath)))
        staging = staging_path(path)
        logging = logging_a_step(self.lightning_module.trainer)
        self._wait_for_write()
        if self.is_global_zero:
            if not logging:
                # Outside a step's end hooks, the step of any waiting save is logged (SIGTERM's `last.ckpt` comes
                # after it, before the next batch): publish those first, so that saves of one path land in order.
                self._logged = len(self._unpublished)
            self._publish(wait=True)
            remove(staging)  # left by a crashed save
        self.barrier()
        background = self.async_checkpoint and logging
        if self.save_distributed_checkpoint and storage_options is None:
            self._save_sharded(checkpoint, staging, background)
        else:
            if "optimizer_states" in checkpoint and self.extra_state():
                rank_zero_warn(
                    f"save_distributed_checkpoint=False: the single file holds the model and optimizers only, not "
                    f"{type(self).__name__}'s own state (extra_state), which a run resumed from it starts afresh. "
                    "Set save_distributed_checkpoint=True to keep it."
                )
            super().save_checkpoint(checkpoint, staging, storage_options)
        self.barrier()
        if self.is_global_zero:
            if logging:
                entry = (staging, path, self._in_flight)
                queued = [e[:2] for e in self._unpublished]
                if entry[:2] in queued:  # saved again in its step: published once, where it was first queued
                    at = queued.index(entry[:2])
                    self._unpublished = (*self._unpublished[:at], entry, *self._unpublished[at + 1 :])
                else:
                    self._unpublished += (entry,)
            else:
                publish(staging, path)
        self.barrier()

    def _save_sharded(self, checkpoint: dict[str, Any], path: Path, background: bool = False) -> None:
        """Write what Lightning's ModelParallelStrategy writes (the model as `state_dict` and each optimizer as
        `optimizer_<i>` through DCP, the loops' state to `meta.pt` by rank 0) plus `extra_state()` in the same DCP
        save, so that one `.metadata` describes all of it. `background`: staged in memory here, written by DCP's
        thread (`_in_flight`)."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        path.mkdir(parents=True, exist_ok=True)
        rest = dict(checkpoint)
        full = "optimizer_states" in rest  # a weights-only checkpoint has none, and no training state at all
        sharded = {"state_dict": rest.pop("state_dict")}
        sharded.update({f"optimizer_{i}": state for i, state in enumerate(rest.pop("optimizer_states", []))})
        extra = self.extra_state() if full else {}
        if extra:
            sharded[self.EXTRA_STATE_KEY] = extra
        if background:
            if self._writes_group is None:  # the training's groups stay the main thread's: collectives keep their order
                self._writes_group = dist.new_group(backend="gloo", timeout=self.collective_timeout)
            self._in_flight = dcp.async_save(sharded, checkpoint_id=str(path), process_group=self._writes_group)
        else:
            dcp.save(sharded, checkpoint_id=str(path))
        if self.global_rank == 0:
            torch.save(rest, path / "meta.pt")

    @property
    def adapters_only(self) -> bool:
        """Whether checkpoints hold the trainable parameters only: the model trains LoRA adapters on frozen base
        weights, which each run gets where the first one did (`pretrained`, or the seed)."""
        return has_adapters(self.lightning_module)

    def saved_parameters(self) -> list[str] | None:
        """The model's state-dict keys a checkpoint holds (None: all of them)."""
        return trainable_names(self.model) if self.adapters_only else None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        full = not self.save_distributed_checkpoint
        options = StateDictOptions(full_state_dict=full, cpu_offload=True, ignore_frozen_params=self.adapters_only)
        return get_model_state_dict(self.model, options=options)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if not self.save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer), options=FLAT)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        return self._load_sharded(path, weights_only) if path.is_dir() else self._load_single_file(path, weights_only)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        # ModelCheckpoint removes the checkpoint a save replaces (save_top_k, a renamed `last`) right after that save:
        # removed before the save is published, a kill in between would leave no checkpoint to resume from.
        if self._unpublished:
            self._unpublished += ((None, Path(filepath), None),)
        else:
            super().remove_checkpoint(filepath)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # The loop logged the previous step before it starts this one (every batch comes here, `batch_to_device` not
        # when the training step takes the dataloader iterator).
        self._logged = len(self._unpublished)
        self._publish()
        super().on_train_batch_start(batch, batch_idx)

    @override
    def on_train_end(self) -> None:
        self._wait_for_write()
        self._logged = len(self._unpublished)
        self._publish(wait=True)
        super().on_train_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Lightning raises SIGTERMException once the step is logged, before the next batch starts: that step's saves
        # are published, a background write waited for. An exception from inside a step's end hooks leaves them
        # unpublished, as a kill there would; so does a crash in a background write.
        trainer = attached_trainer(self.lightning_module)
        if trainer is None:  # interrupted before the fit began: nothing written, nothing to publish
            super().on_exception(exception)
            return
        if not logging_a_step(trainer):
            self._logged = len(self._unpublished)
        stopped = isinstance(exception, SIGTERMException)
        if stopped:
            self._wait_for_write()
        self._publish(wait=stopped)
        super().on_exception(exception)

    def _wait_for_write(self) -> None:
        """Wait for this rank's background write, if one is in flight; a failed write raises here."""
        write, self._in_flight = self._in_flight, None
        if write is not None:
            write.result()

    def _publish(self, wait: bool = False) -> None:
        """Publish, in the order asked, the checkpoints of logged steps whose write is complete (`wait`: waiting for
        it), and make the removals queued behind them (see `save_checkpoint`). Rank 0's: DCP's last collective ends
        every rank's write before rank 0's."""
        while self._logged:
            staging, path, write = self._unpublished[0]
            if write is not None and not (wait or write.done()):
                return
            if write is not None:
                write.result()
            self._unpublished, self._logged = self._unpublished[1:], self._logged - 1
            if staging is None:
                super().remove_checkpoint(path)
            else:
                publish(staging, path)

    def _load_sharded(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        saved = self.saved_parameters()
        check_compatible(self.model, path, names=saved)
        current = get_model_state_dict(self.model)
        state = {"state_dict": {k: v for k, v in current.items() if saved is None or k in saved}}
        load_sharded(state, path)
        strict = self.lightning_module.strict_loading
        set_model_state_dict(self.model, {**current, **state["state_dict"]}, options=StateDictOptions(strict=strict))
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            state = {key: get_optimizer_state_dict(self.model, optimizer, options=FLAT)}
            load_sharded(state, path)
            set_optimizer_state_dict(self.model, optimizer, state[key], options=FLAT)
        self.load_extra_state(self._extra_state_reader(path))
        return load_meta(path, weights_only=weights_only is not False)

    def _extra_state_reader(self, path: Path) -> Callable[[dict[str, Any]], dict[str, Any]]:
        """The `read` that `load_extra_state` gets for the DCP checkpoint at `path`."""
        saved = set(read_metadata(path).state_dict_metadata)
        prefix = f"{self.EXTRA_STATE_KEY}."

        def read(template: dict[str, Any]) -> dict[str, Any]:
            found = {key: value for key, value in template.items() if prefix + key in saved}
            # Every rank loads, even one that asks for nothing: DCP plans the load collectively.
            load_sharded({self.EXTRA_STATE_KEY: found}, path)
            return found

        return read

    def _load_single_file(self, path: Path, weights_only: bool | None) -> dict[str, Any]:
        """Load a `save_distributed_checkpoint=False` file. Every rank maps it (mmap: only the pages it reads) and
        takes the parameters it holds; Lightning's own loader broadcasts every tensor from rank 0 instead, which
        fails when ranks hold different parameters (pipeline stages)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only is not False)
        weights = checkpoint.pop("state_dict")
        check_compatible(self.model, path, weights, names=self.saved_parameters())
        held = set(self.model.state_dict())
        options = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, {k: v for k, v in weights.items() if k in held}, options=options)
        # Left in the checkpoint: Lightning checks it is there before restoring (a no-op here) the optimizers.
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            state = self._keyed_by_name(state)
            groups = [{**group, "params": [p for p in group["params"] if p in held]} for group in state["param_groups"]]
            mine = {"state": {k: v for k, v in state["state"].items() if k in held}, "param_groups": groups}
            set_optimizer_state_dict(self.model, optimizer, mine, options=options)
        return checkpoint

    def _keyed_by_name(self, state: dict[str, Any]) -> dict[str, Any]:
        """An optimizer state keyed by parameter index, as a single file holds it (Lightning numbers parameters in
        the whole model's order so that one plain process can load it too), keyed by parameter name instead."""
        if not any(isinstance(p, int) for group in state["param_groups"] for p in group["params"]):
            return state
        names = self._parameter_names
        return {
            "state": {names[index]: value for index, value in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
        }
