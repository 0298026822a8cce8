"""Monitors a user watches during a run: throughput, per-rank step time with the straggler ratio, peak memory."""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import ThroughputMonitor as LightningThroughputMonitor
from typing_extensions import override

from parallelkit.callbacks.activations import SavedTensorWindow
from parallelkit.compat import should_accumulate, throughputs
from parallelkit.memory import peak_rss_bytes, training_state_bytes
from parallelkit.mesh import data_parallel_size
from parallelkit.parallel.resolve import resolve


def _samples(batch: Any) -> int:
    return int(batch[0].size(0))


def _tokens(batch: Any) -> int:
    return int(batch[0].numel())


class ThroughputMonitor(LightningThroughputMonitor):
    """Lightning's ThroughputMonitor for token batches `(inputs, targets)`, counting replicas, not processes.

    Logs `train/samples_per_sec` and `train/items_per_sec` (tokens/s) for the whole job, `train/device/...` for
    rank 0, and MFU (`train/device/mfu`) when the device's peak FLOP/s are known (CUDA). FLOPs come from the model's
    plan (`flops_per_token`, `parallelkit.contract`): before each batch the monitor sets the module's
    `flops_per_batch`, Lightning's attribute, to what this process performs (its layers, its tp share).
    Tensor- and pipeline-parallel ranks of one replica share a batch, so the job-wide figures scale with the
    data-parallel size, where Lightning's would multiply by the world size.

    Args:
        batch_size_fn: Samples in a batch (default: the batch's inputs' first dim, the inputs as the model's plan
            finds them in a batch: `batch[0]` of `(inputs, targets)`).
        length_fn: Tokens in a batch (default: the number of elements of the inputs).
        window_size: Steps the rates are averaged over (they appear once that many steps have run).
        **kwargs: Passed to Lightning's `Throughput`.
    """

    def __init__(
        self, batch_size_fn: Any = _samples, length_fn: Any = _tokens, window_size: int = 5, **kwargs: Any
    ) -> None:
        super().__init__(batch_size_fn=batch_size_fn, length_fn=length_fn, window_size=window_size, **kwargs)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        meters = throughputs(self)
        for key in meters:
            meters[key] = _ReplicaThroughput(
                trainer.world_size,
                available_flops=self.available_flops,
                world_size=data_parallel_size(trainer.strategy),
                **self.kwargs,
            )
        # The plan the strategy resolved; a strategy that resolves none (Lightning's own, DDP) leaves it to this one.
        resolved = getattr(trainer.strategy, "resolved", None) or resolve(pl_module)
        self._plan = resolved.plan
        self._flops_per_token: dict[int, float] = {}
        split = self._plan.split_batch  # the model's batch convention: its inputs are what is counted
        if self.batch_size_fn is _samples:
            self.batch_size_fn = lambda batch: _samples(split(batch))
        if self.length_fn is _tokens:
            self.length_fn = lambda batch: _tokens(split(batch))

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._plan.flops_per_token is None:
            return
        inputs, _ = self._plan.split_batch(batch)
        seq_len = inputs.size(1)
        if seq_len not in self._flops_per_token:  # the layers this process holds (a pipeline stage: its own)
            self._flops_per_token[seq_len] = self._plan.flops_per_token(seq_len)
        # Parameter counts are global (DTensor): the tp ranks of a replica split each layer's work between them.
        spec = getattr(trainer.strategy, "mesh_spec", None)
        tp = spec.size("tp") if spec is not None else 1
        pl_module.flops_per_batch = self._flops_per_token[seq_len] * inputs.numel() / tp


class _ReplicaThroughput(Throughput):
    """Job-wide rates from rank 0's: samples and tokens times the replicas; FLOPs times the processes (each
    performs its own share, `flops_per_batch`)."""

    def __init__(self, processes: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.processes = processes

    @override
    def compute(self) -> dict[str, int | float]:
        metrics = super().compute()
        prefix = f"device{self.separator}"
        for key, value in list(metrics.items()):
            if key.startswith(prefix) and key != f"{prefix}mfu":
                name = key.removeprefix(prefix)
                # Lightning leaves job-wide rates out for one replica; tp/pp jobs have one and still want them.
                metrics[name] = value * (self.processes if name == "flops_per_sec" else self.world_size)
        return metrics


class RankMonitor(L.Callback):
    """Per-rank step time and peak memory, gathered from every rank, logged with the straggler ratio.

    Every `every_n_steps` optimizer steps (default: the trainer's `log_every_n_steps`), each rank's mean step
    time over the window and its peak memory are all-gathered (one small collective) and logged:

    - `rank/step_s` (median rank), `rank/step_s_max`, `rank/straggler` = slowest / median rank (progress bar);
    - `memory/peak_mb`: the largest rank's peak. On CUDA, the allocator's max allocated bytes. On CPU, where no
      allocator keeps a peak, the tensor peak as counted: parameters + gradients + optimizer state (local shards,
      at the end of the first step) + the most bytes autograd held for backward during a step. Transient buffers
      (gathered FSDP parameters, communication buffers, the step's last outputs) are not in the CPU figure.
    - `memory/state_mb`, `memory/activations_mb` (largest rank), and on CPU `memory/rss_peak_mb` (the process's
      peak resident memory, Python and libraries included).
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        self.every_n_steps = every_n_steps
        self._step_start: float | None = None
        self._times: list[float] = []
        self._window = SavedTensorWindow()
        self._activations = 0
        self._state = 0

    @staticmethod
    def _cuda(trainer: L.Trainer) -> bool:
        return trainer.strategy.root_device.type == "cuda"

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._step_start is None:  # first micro-batch of an optimizer step
            self._step_start = time.perf_counter()
        if not self._cuda(trainer):
            self._window.start(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._activations = max(self._activations, self._window.stop())
        if should_accumulate(trainer):
            return  # the optimizer step, and so the step time, ends with the last micro-batch
        if self._cuda(trainer):
            torch.cuda.synchronize()
        self._times.append(time.perf_counter() - self._step_start)
        self._step_start = None
        if not self._state:  # fixed once the first step has made gradients and optimizer state: count it once
            self._state = training_state_bytes(pl_module, trainer.optimizers)
        every = self.every_n_steps or trainer.log_every_n_steps
        if trainer.global_step % every == 0:
            self._log(trainer, pl_module)

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        if self._cuda(trainer):
            peak, rss = torch.cuda.max_memory_allocated(device), 0
        else:
            peak, rss = self._state + self._activations, peak_rss_bytes()
        mine = torch.tensor(
            [statistics.fmean(self._times), peak, self._state, self._activations, rss],
            dtype=torch.float64,
            device=device,
        )
        self._times.clear()
        everyone = _gather_from_every_rank(mine).cpu()
        times = everyone[:, 0].tolist()
        median = statistics.median(times)
        metrics = {
            "rank/step_s": median,
            "rank/step_s_max": max(times),
            "rank/straggler": max(times) / median if median > 0 else 1.0,
            "memory/peak_mb": everyone[:, 1].max().item() / 2**20,
            "memory/state_mb": everyone[:, 2].max().item() / 2**20,
            "memory/activations_mb": everyone[:, 3].max().item() / 2**20,
        }
        if not self._cuda(trainer):
            metrics["memory/rss_peak_mb"] = everyone[:, 4].max().item() / 2**20
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, rank_zero_only=True, prog_bar=name == "rank/straggler")


def _gather_from_every_rank(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` of every rank stacked by rank (Lightning's strategy.all_gather goes through a deprecated torch API)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return tensor.unsqueeze(0)
    gathered = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, tensor)
    return torch.stack(gathered)
