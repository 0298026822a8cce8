"""`parallelkit env`: what a distributed run would see on this machine."""

from __future__ import annotations

import argparse
import os
import platform
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from rich.console import Console
from rich.table import Table

import parallelkit
from parallelkit.mesh import MeshSpec


def _versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "parallelkit": parallelkit.__version__}
    for dist in ("torch", "lightning", "jsonargparse", "torchmetrics", "wandb"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = "not installed"
    return found


def env_command(argv: Sequence[str]) -> int:
    """Print what a distributed run would see on this machine (and, given a mesh, who sits where)."""
    parser = argparse.ArgumentParser(prog="parallelkit env", description=env_command.__doc__)
    parser.add_argument("--mesh", help='mesh_shape to lay out, e.g. \'[[2, 2], ["fsdp", "tp"]]\'')
    parser.add_argument("--devices", type=int, help="processes per node (default: WORLD_SIZE or 1)")
    parser.add_argument("--num-nodes", type=int, default=1, help="number of nodes (default: 1)")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    console = Console()
    table = Table(title="parallelkit env", show_header=False)
    for name, ver in _versions().items():
        table.add_row(name, ver)
    backends = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}
    table.add_row("backends", ", ".join(f"{b}: {'yes' if ok else 'no'}" for b, ok in backends.items()))
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    kinds = sorted({torch.cuda.get_device_name(i) for i in range(cuda)})
    table.add_row(
        "devices", f"cuda: {cuda}" + (f" ({', '.join(kinds)})" if kinds else "") + f"; cpu cores: {os.cpu_count()}"
    )
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        table.add_row(var, os.environ.get(var, "(unset)"))
    console.print(table)

    if args.mesh:
        devices = args.devices or int(os.environ.get("WORLD_SIZE", 1)) // args.num_nodes
        spec = MeshSpec.parse(args.mesh).resolve(args.num_nodes, devices)
        layout = Table(title=f"mesh {spec}: {spec.world_size} ranks, data-parallel size {spec.dp_size}")
        layout.add_column("rank", justify="right")
        layout.add_column("node", justify="right")
        for name in spec.names:
            layout.add_column(name, justify="right")
        layout.add_column("dp rank", justify="right")
        for rank in range(spec.world_size):
            coords = spec.coordinates(rank)
            row = [str(rank), str(rank // devices), *(str(coords[n]) for n in spec.names), str(spec.dp_rank(rank))]
            layout.add_row(*row)
        console.print(layout)
    return 0
