"""Datamodules whose global sample order is the same for every parallel layout."""

from parallelkit.data.preference import PreferenceDataModule
from parallelkit.data.sampler import GlobalBatchSampler
from parallelkit.data.sft import SFTDataModule
from parallelkit.data.synthetic import SyntheticDataModule
from parallelkit.data.text import TextDataModule
from parallelkit.data.tokenized import TokenizedDataModule

__all__ = [
    "GlobalBatchSampler",
    "PreferenceDataModule",
    "SFTDataModule",
    "SyntheticDataModule",
    "TextDataModule",
    "TokenizedDataModule",
]
