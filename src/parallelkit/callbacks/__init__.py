"""Monitors that Lightning lacks, and Lightning's ThroughputMonitor made mesh-aware."""

from parallelkit.callbacks.activations import ActivationMemoryMonitor
from parallelkit.callbacks.comm import CommunicationMonitor
from parallelkit.callbacks.experts import ExpertMonitor
from parallelkit.callbacks.monitors import RankMonitor, ThroughputMonitor
from parallelkit.callbacks.preemption import PreemptionCheckpoint
from parallelkit.callbacks.replicas import ReplicaMismatch, ReplicaMonitor

__all__ = [
    "ActivationMemoryMonitor",
    "CommunicationMonitor",
    "ExpertMonitor",
    "PreemptionCheckpoint",
    "RankMonitor",
    "ReplicaMismatch",
    "ReplicaMonitor",
    "ThroughputMonitor",
]
