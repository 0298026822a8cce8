"""Monitors that Lightning lacks."""

from parallelkit.callbacks.activations import ActivationMemoryMonitor
from parallelkit.callbacks.comm import CommunicationMonitor
from parallelkit.callbacks.preemption import PreemptionCheckpoint

__all__ = ["ActivationMemoryMonitor", "CommunicationMonitor", "PreemptionCheckpoint"]
