"""GlobalBatchSampler: one global sample order, sliced per data-parallel rank, resumable mid-epoch.

Loss parity across layouts needs global batch k to hold the same samples whatever the data-parallel
size. Lightning's default DistributedSampler deals samples round-robin (rank r takes every n-th), so
the same global batch size over 1 or 2 ranks sees different samples. Here the order is drawn once for
the whole job and each global batch is cut into contiguous per-rank slices.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch.utils.data import DistributedSampler

from parallelkit.errors import DataError


class GlobalBatchSampler(DistributedSampler):
    """Yields this rank's slice of each global batch of a seeded, epoch-dependent permutation.

    With ``G = batch_size * num_replicas``, each epoch draws ``perm`` (a permutation of
    ``range(dataset_len)`` from ``torch.Generator().manual_seed(seed + epoch)``, or ``arange`` without
    shuffling), keeps only complete global batches, and rank ``r`` yields
    ``perm[k*G + r*batch_size : k*G + (r+1)*batch_size]`` for ``k = 0, 1, ...``. A
    ``DataLoader(dataset, batch_size=batch_size, sampler=this)`` therefore hands rank ``r`` exactly its
    slice of global batch ``k``, and the union over ranks of batch ``k`` does not depend on
    ``num_replicas``.

    It subclasses ``DistributedSampler`` so that Lightning neither replaces it with its own (it only
    replaces samplers that are not DistributedSamplers) nor forgets to call ``set_epoch`` on it. No
    process group is needed: the layout is passed in.

    Args:
        dataset_len: number of samples in the dataset.
        batch_size: samples per rank per step (the per-process micro-batch).
        num_replicas: data-parallel size (ranks sharing each global batch).
        rank: this process's data-parallel rank, in ``[0, num_replicas)``.
        shuffle: draw a fresh seeded permutation each epoch; ``False`` keeps dataset order.
        seed: base seed; epoch ``e`` uses ``seed + e``, identically on every rank.
    """

    def __init__(
        self,
        dataset_len: int,
        batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if batch_size < 1:
            raise DataError(f"batch_size is {batch_size}; it must be at least 1. Fix: set data.batch_size >= 1.")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise DataError(
                f"rank {rank} is outside the data-parallel group of size {num_replicas}; ranks run from 0 to "
                f"num_replicas - 1. Fix: pass the data-parallel rank and size, not the global ones."
            )
        global_batch_size = batch_size * num_replicas
        if dataset_len < global_batch_size:
            raise DataError(
                f"The dataset has {dataset_len} samples, fewer than one global batch of {global_batch_size} "
                f"(batch_size {batch_size} x data-parallel size {num_replicas}). Fix: use more data, or "
                f"lower the batch size or the number of data-parallel processes."
            )
        # DistributedSampler only needs something sized; a range costs nothing and needs no process group.
        super().__init__(range(dataset_len), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.batch_size = batch_size
        self.global_batch_size = global_batch_size
        self.num_global_batches = dataset_len // global_batch_size
        # The tail that does not fill a global batch is dropped so every rank steps the same number of times.
        self.total_size = self.num_global_batches * global_batch_size
        # DistributedSampler.__len__ returns num_samples: a full epoch's share, even when resuming mid-epoch,
        # because Lightning's batch_idx continues from the restored count rather than from 0.
        self.num_samples = self.num_global_batches * batch_size
        self._resume_epoch: int | None = None
        self._resume_offset = 0

    def __iter__(self) -> Iterator[int]:
        # Built eagerly (not a generator) so the one-shot resume offset is consumed when iteration starts.
        batches, first = self.epoch_batches()
        return iter(batches[first:, self.rank].reshape(-1).tolist())

    def epoch_batches(self) -> tuple[torch.Tensor, int]:
        """This epoch's global batches of sample indices, (num_global_batches, num_replicas, batch_size), and the
        index of the first to run: 0, or after a resume the one it stopped before (the offset is used up)."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator)
        else:
            order = torch.arange(len(self.dataset))
        start = self._resume_offset if self.epoch == self._resume_epoch else 0
        self._resume_epoch, self._resume_offset = None, 0
        batches = order[: self.total_size].view(self.num_global_batches, self.num_replicas, self.batch_size)
        return batches, start // self.global_batch_size

    def state_dict(self, batches_done: int) -> dict[str, int]:
        """Position after ``batches_done`` steps of the current epoch, in global samples.

        Stored in samples rather than batches so a resume may change the layout (say 2 ranks x 4 to
        4 ranks x 2): the same global sample is the same point in the data.
        """
        return {"epoch": self.epoch, "samples_seen": batches_done * self.global_batch_size}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Make the next iteration of ``state["epoch"]`` start at global sample ``state["samples_seen"]``.

        A position at or past the end of the epoch's complete global batches means the next epoch from
        its start. The offset applies once: later epochs start at 0.
        """
        epoch, samples_seen = int(state["epoch"]), int(state["samples_seen"])
        if samples_seen >= self.total_size:
            epoch, samples_seen = epoch + 1, 0
        elif samples_seen < 0 or samples_seen % self.global_batch_size:
            raise DataError(
                f"Cannot resume at samples_seen={samples_seen}: it is not a whole number of global batches "
                f"of {self.global_batch_size} (batch_size {self.batch_size} x data-parallel size "
                f"{self.num_replicas}). Fix: resume with a layout whose global batch size divides "
                f"{samples_seen} (normally the one the checkpoint was written with)."
            )
        self.epoch = epoch
        self._resume_epoch, self._resume_offset = epoch, samples_seen
