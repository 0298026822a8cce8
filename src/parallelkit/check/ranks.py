"""What each rank of `parallelkit check` reports about itself (host, device, versions, launcher, communication
environment), and the fields on which the ranks disagree."""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Sequence
from typing import Any

import torch

import parallelkit

ENV_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE",
    "NCCL_P2P_LEVEL",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_DEBUG",
    "GLOO_SOCKET_IFNAME",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_TRACE_BUFFER_SIZE",
)
"""Launcher and communication variables that change what a job's collectives do (printed when set)."""

COMPARED = ("device", "capability", "device_memory", "torch", "cuda", "nccl", "driver", "python", "parallelkit")
"""What every rank must agree on (a mixed cluster is refused unless `--allow-mixed`)."""


def launcher_name() -> str:
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    if os.environ.get("SLURM_JOB_ID"):
        return "slurm"
    return "lightning"


def rank_report(rank: int, device: torch.device) -> dict[str, Any]:
    """What this rank runs on: host, device, versions, launcher and the communication environment."""
    cuda = device.type == "cuda"
    props = torch.cuda.get_device_properties(device) if cuda else None
    driver = "-"
    if cuda and os.path.exists("/proc/driver/nvidia/version"):
        with open("/proc/driver/nvidia/version") as f:
            words = f.readline().split()
        driver = next((w for w in words if w[:1].isdigit() and "." in w), "-")
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": props.name if props else f"cpu ({platform.machine()})",
        "capability": f"{props.major}.{props.minor}" if props else "-",
        "device_memory": props.total_memory if props else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "-",
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-",
        "driver": driver,
        "python": platform.python_version(),
        "parallelkit": parallelkit.__version__,
        "launcher": launcher_name(),
        "env": {name: os.environ[name] for name in ENV_VARS if name in os.environ},
    }


def differences(reports: Sequence[dict[str, Any]]) -> dict[str, dict[Any, list[int]]]:
    """For each compared field on which the ranks disagree: value -> the ranks reporting it."""
    found: dict[str, dict[Any, list[int]]] = {}
    for key in COMPARED:
        values: dict[Any, list[int]] = {}
        for report in reports:
            values.setdefault(report[key], []).append(report["rank"])
        if len(values) > 1:
            found[key] = values
    return found


def describe_differences(found: dict[str, dict[Any, list[int]]]) -> list[str]:
    lines = []
    for key, values in found.items():
        common = max(values, key=lambda v: len(values[v]))
        odd = "; ".join(
            f"{'rank' if len(r) == 1 else 'ranks'} {_ranks(r)} {'reports' if len(r) == 1 else 'report'} {v!r}"
            for v, r in values.items()
            if v != common
        )
        lines.append(f"{key}: {odd}, where the other ranks report {common!r}")
    return lines


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))
