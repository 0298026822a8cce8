"""Monitors that Lightning lacks."""

from parallelkit.callbacks.activations import ActivationMemoryMonitor
from parallelkit.callbacks.comm import CommunicationMonitor

__all__ = ["ActivationMemoryMonitor", "CommunicationMonitor"]
