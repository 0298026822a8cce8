"""Random tokens: a dataset that needs no disk, for benchmarks and loss-parity checks."""

from __future__ import annotations

import torch
from typing_extensions import override

from parallelkit.data.stream import TokenStreamDataModule, TokenWindows
from parallelkit.errors import DataError


class SyntheticDataModule(TokenStreamDataModule):
    """Uniformly random tokens, generated from ``seed`` so every rank builds the identical dataset.

    One stream of ``(num_samples + val_samples) * seq_len + 1`` tokens is drawn; the first
    ``num_samples`` windows train and the next ``val_samples`` validate (and test). Batching, the
    global sample order across data-parallel ranks and mid-epoch resume are those of
    ``TextDataModule``.

    Args:
        seq_len: tokens per sample (the model's context length).
        batch_size: samples per process per step (the micro-batch); the global batch is
            ``batch_size x data-parallel size x accumulate_grad_batches``.
        seed: seed of the tokens and of the training order (epoch ``e`` shuffles with ``seed + e``).
        vocab_size: tokens are drawn from ``[0, vocab_size)``; match the model's vocabulary.
        num_samples: training samples.
        val_samples: validation (and test) samples.
        num_workers: DataLoader worker processes per rank.
    """

    def __init__(
        self,
        seq_len: int = 128,
        batch_size: int = 8,
        seed: int = 1234,
        vocab_size: int = 256,
        num_samples: int = 4096,
        val_samples: int = 256,
        num_workers: int = 0,
    ) -> None:
        super().__init__(seq_len=seq_len, batch_size=batch_size, seed=seed, num_workers=num_workers)
        if vocab_size < 1:
            raise DataError(f"vocab_size is {vocab_size}; it must be at least 1. Fix: set data.vocab_size >= 1.")
        if num_samples < 0 or val_samples < 0:
            raise DataError(
                f"num_samples is {num_samples} and val_samples {val_samples}; neither may be negative. "
                f"Fix: set data.num_samples and data.val_samples >= 0."
            )
        self.vocab_size = vocab_size
        self.num_samples = num_samples
        self.val_samples = val_samples

    def describe(self, split: str) -> str:
        return f"The synthetic {split} split (num_samples {self.num_samples}, val_samples {self.val_samples})"

    def more_data_hint(self, split: str) -> str:
        return "raise data.val_samples" if split == "val" else "raise data.num_samples"

    @override
    def setup(self, stage: str | None = None) -> None:
        boundary = self.num_samples * self.seq_len
        length = (self.num_samples + self.val_samples) * self.seq_len + 1
        generator = torch.Generator().manual_seed(self.seed)
        tokens = torch.randint(0, self.vocab_size, (length,), generator=generator).numpy()
        # The val split starts on the last training target so both splits keep whole windows.
        self.train_set = TokenWindows(tokens[: boundary + 1], self.seq_len)
        self.val_set = TokenWindows(tokens[boundary:], self.seq_len)
