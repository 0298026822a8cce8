"""Monitors that Lightning lacks."""

from parallelkit.callbacks.activations import ActivationMemoryMonitor

__all__ = ["ActivationMemoryMonitor"]
