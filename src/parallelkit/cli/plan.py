"""`parallelkit plan`: every mesh's memory, communication and step time for a run, and a recommendation."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from typing_extensions import override

from parallelkit import plugins
from parallelkit.cli.config import parse_size, read_config
from parallelkit.cli.lightning_cli import ParallelkitCLI
from parallelkit.errors import ConfigError, MeshError
from parallelkit.init import meta_parameters
from parallelkit.memory import gb
from parallelkit.mesh import MeshSpec
from parallelkit.planner.records import MEMORY_HEADROOM, Hardware


@dataclass(frozen=True)
class Column:
    """One column of `parallelkit plan`'s table: its header, the Estimate.as_dict() fields it shows, their cell."""

    header: str
    fields: tuple[str, ...]
    cell: Callable[..., str]
    left: bool = False


def mesh_axes(mesh: str) -> str:
    """A mesh as its axes of more than one rank, e.g. "pp=4 fsdp=2 tp=4" (the recommendation says it whole)."""
    spec = MeshSpec.parse(mesh)
    return " ".join(f"{name}={size}" for name, size in zip(spec.names, spec.sizes) if size > 1) or "1 process"


def size_text(count: float) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"


def seconds_text(seconds: float) -> str:
    return f"{seconds:,.0f} s" if seconds >= 100 else f"{seconds:.3g} s"


PLAN_COLUMNS: tuple[Column, ...] = (
    Column("mesh", ("mesh",), mesh_axes, left=True),
    Column(
        "schedule",
        ("schedule",),
        lambda schedule: {"interleaved_1f1b": "interleaved"}.get(schedule, schedule or "-"),
        left=True,
    ),
    Column("ckpt", ("activation_checkpointing",), str),
    Column("mb x acc", ("micro_batch", "accumulate"), lambda micro, accumulate: f"{micro} x {accumulate}"),
    Column("activations", ("activations",), gb),
    Column("peak", ("peak",), gb),
    Column("fits", ("fits",), lambda fits: "yes" if fits else "[red]no[/]"),
    Column("step", ("step_s",), seconds_text),
    Column("tokens/s", ("tokens_per_s",), lambda tokens: f"{tokens:,.0f}"),
)
"""`parallelkit plan`'s table, what tells layouts apart at a glance: the layout and the settings it takes (activation
checkpointing, micro-batch x accumulation), the activations they leave, the peak and whether it fits, how fast. One
record, so a header cannot go missing."""

PLAN_TABLE_OMITS = {
    "params",
    "grads",
    "optimizer",
    "state",
    "tensor_peak",
    "gathered",
    "comm",
    "data_parallel",
    "global_batch",
}
"""Estimate.as_dict() fields the table leaves to --json: the parts of the peak but activations (parameters,
gradients, optimizer state, FSDP's gathered buffers), the traffic per axis, and the data-parallel size and global
batch (every row's is the one stated above the table)."""

PLAN_WIDTH = 120
"""Characters the human output fits in."""


class MetaModelCLI(ParallelkitCLI):
    """The run's config read as `fit` reads it (LightningCLI's own parser: defaults, class paths, overrides, linked
    arguments), its model built on the meta device, nothing launched."""

    def __init__(self, config: str, overrides: Sequence[str]) -> None:
        with warnings.catch_warnings():  # "args and command line arguments": the tool's own options are sys.argv's
            warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python")
            # Nothing is drawn at random on the meta device: no seed, and no "No seed found" when a preset has none.
            super().__init__(args=["--config", config, *overrides], run=False, seed_everything_default=False)

    @override
    def instantiate_classes(self) -> None:
        """The model (on the meta device) and the datamodule, not the Trainer: the config names the cluster's
        devices, which this machine need not have."""
        with meta_parameters():
            instantiate = getattr(self.parser, "instantiate", None) or self.parser.instantiate_classes  # < 4.49
            self.config_init = instantiate(self.config)
        self.model = self.config_init["model"]
        self.datamodule = self.config_init["data"]
        trainer = self.config_init["trainer"]
        self.precision = str(trainer.get("precision") or "32-true")
        self.accumulate = int(trainer.get("accumulate_grad_batches") or 1)
        self.activation_checkpointing = getattr(trainer.get("strategy"), "activation_checkpointing", None)


def plan_parser() -> argparse.ArgumentParser:
    """`parallelkit plan`'s options, each help text with its default."""
    hw = Hardware(1, 1, 1.0)  # the planner's own defaults
    parser = argparse.ArgumentParser(prog="parallelkit plan", description=plan_command.__doc__)
    parser.add_argument("--config", required=True, help="the run's YAML (model, data, trainer as for `fit`); required")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the cluster (default: %(default)s)")
    parser.add_argument("--devices-per-node", type=int, required=True, help="devices of each node; required")
    parser.add_argument("--device-memory", required=True, help="memory of each device, e.g. 80GB or 24GiB; required")
    parser.add_argument(
        "--memory-headroom",
        default=str(MEMORY_HEADROOM),
        help="memory of each device a layout must leave free (the CUDA context, the allocator, NCCL's buffers): a "
        "share of --device-memory (0.1 or 10%%) or a size (8GB) (default: %(default)s)",
    )
    parser.add_argument("--seq-len", type=int, help="tokens per sample (default: the config's data.init_args.seq_len)")
    parser.add_argument(
        "--global-batch",
        type=int,
        help="samples per optimizer step over the whole job, the same for every layout (default: the config's "
        "data.batch_size x accumulate_grad_batches x its data-parallel size here: its mesh_shape's, auto as its "
        "strategy starts it; every process for DDP or a mesh of other sizes)",
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        help="samples per process per forward, accumulated up to the process's share of the global batch (default: "
        "every divisor of that share is tried)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        type=lambda value: int(value) if value.isdigit() else value,
        help="none, full or n (every n-th block) (default: none, every 2nd and full are tried)",
    )
    parser.add_argument(
        "--optimizer",
        choices=["adamw", "adam", "sgd_momentum", "sgd", "muon"],
        default="adamw",
        help="what the optimizer state is sized for (default: %(default)s)",
    )
    parser.add_argument(
        "--intra-node-gbps",
        type=float,
        default=hw.intra_node_gbps,
        help="GB/s between the devices of a node (default: %(default)s)",
    )
    parser.add_argument(
        "--inter-node-gbps", type=float, default=hw.inter_node_gbps, help="GB/s between nodes (default: %(default)s)"
    )
    parser.add_argument(
        "--device-tflops",
        type=float,
        default=hw.device_tflops,
        help="peak dense TFLOP/s of a device (default: %(default)s)",
    )
    parser.add_argument(
        "--mfu", type=float, default=hw.mfu, help="share of --device-tflops a step achieves (default: %(default)s)"
    )
    parser.add_argument(
        "--no-pipeline",
        action="store_true",
        help="only fsdp/tp/hsdp meshes, those fsdp_tp's mesh_shape: auto chooses from (default: pipelines too)",
    )
    parser.add_argument("--json", action="store_true", help="machine-readable, every field (default: a table)")
    parser.epilog = "Other options are fit's overrides of the config, e.g. --model.init_args.n_layer=48."
    return parser


def memory_headroom(text: str, device_memory: float) -> float:
    """--memory-headroom as a share of the device's memory: given as a share (0.1, 10%) or a size (8GB)."""
    lowered = text.strip().lower()
    try:
        share = float(lowered[:-1]) / 100 if lowered.endswith("%") else float(lowered)
    except ValueError:
        share = parse_size(text, "--memory-headroom") / device_memory
    if not 0 <= share < 1:
        raise ConfigError(
            f"--memory-headroom {text}: {share:.3g} of each {gb(device_memory)} device, which would leave a layout "
            f"{'no' if share >= 1 else 'more than all its'} memory. Fix: a share from 0 to below 1 (default "
            f"{MEMORY_HEADROOM}), or a size below --device-memory, e.g. 8GB."
        )
    return share


def config_data_parallel(strategy: Any, world_size: int) -> tuple[int, str]:
    """The data-parallel size of the config's layout on `world_size` processes, and whose it is: its `mesh_shape`
    (`auto` as its strategy starts it), every process for a strategy without one (DDP) or a mesh of other sizes."""
    mesh = getattr(strategy, "mesh_shape", None)
    if mesh is None:
        return world_size, "every process data-parallel"
    try:
        spec = MeshSpec.parse(strategy.auto_mesh(1, world_size) if mesh == "auto" else mesh).resolve(1, world_size)
    except MeshError:
        return world_size, f"every process data-parallel: the config's mesh is not one of {world_size}"
    return spec.dp_size, f"the config's mesh{' (auto)' if mesh == 'auto' else ''} {spec}"


def plan_command(argv: Sequence[str]) -> int:
    """Estimate per-device memory, communication and step time of every mesh for a run, and recommend one."""
    import json
    from dataclasses import replace

    from parallelkit.planner import layout, recommend, workload, workloads

    args, overrides = plan_parser().parse_known_args(argv)
    plugins.activate()  # strategies registered and known noise quieted before the model is built
    read_config(args.config)  # a missing or broken file named as `fit` names it (jsonargparse's errors do not)
    cli = MetaModelCLI(args.config, overrides)
    model, name = cli.model, type(cli.model).__name__
    work = workload(
        cli.datamodule,
        cli.precision,
        cli.activation_checkpointing if args.activation_checkpointing is None else args.activation_checkpointing,
        cli.accumulate,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        optimizer=args.optimizer,
    )
    if work is None:
        raise ConfigError(
            "plan needs the sequence length and micro-batch: set data.init_args.seq_len/batch_size "
            "in the config, or pass --seq-len and --micro-batch."
        )
    memory = parse_size(args.device_memory)
    hw = Hardware(
        args.nodes,
        args.devices_per_node,
        memory,
        args.intra_node_gbps,
        args.inter_node_gbps,
        args.device_tflops,
        args.mfu,
        memory_headroom(args.memory_headroom, memory),
    )
    if args.global_batch is not None and args.global_batch < 1:
        raise ConfigError(f"--global-batch {args.global_batch}: a step takes at least one sample. Fix: e.g. 256.")
    dp, whose = config_data_parallel(cli.config_init["trainer"].get("strategy"), hw.world_size)
    batch = getattr(cli.datamodule, "batch_size", None) or work.micro_batch  # the config's, whatever --micro-batch
    samples = batch * cli.accumulate
    source = f"data.batch_size {batch} x accumulate_grad_batches {cli.accumulate} x dp {dp} ({whose})"
    if args.global_batch is not None:
        source = "set by --global-batch"
    if args.micro_batch:  # pinned: accumulated up to each layout's share, whatever the config accumulates
        work = replace(work, accumulate=1)
    work = replace(work, global_batch=args.global_batch or samples * dp)
    search = workloads(work, checkpointing=args.activation_checkpointing is None, micro_batch=not args.micro_batch)
    estimates, best, reason = recommend(model, work, hw, pipeline=not args.no_pipeline, search=search)
    if args.json:
        print(
            json.dumps(
                {
                    "workload": work.__dict__,
                    "hardware": {**hw.__dict__, "usable_memory": hw.usable_memory},
                    "estimates": [e.as_dict() for e in estimates],
                    "recommended": best.as_dict() if best else None,
                    "reason": reason,
                },
                indent=2,
            )
        )
        return 0 if best else 1
    console = Console(width=PLAN_WIDTH)
    params = sum(p.numel() for p in model.parameters())
    untried = [size for size in range(2, hw.world_size + 1) if hw.world_size % size == 0 and work.global_batch % size]
    if untried:
        source += f"; layouts of {' or '.join(map(str, untried))} data-parallel ranks cannot split it: not tried"
    console.print(
        f"{name}, {size_text(params)} parameters. Every layout trains the same global batch: {work.global_batch} "
        f"samples of {work.seq_len} tokens a step,\n  {source}."
    )
    console.print(
        f"Assumed: {hw.nodes} x {hw.devices_per_node} devices of {gb(hw.device_memory)}, {gb(hw.usable_memory)} usable "
        f"({hw.memory_headroom:.0%} headroom); {hw.intra_node_gbps:g} GB/s in a node, {hw.inter_node_gbps:g} GB/s "
        f"across nodes;\n  {hw.device_tflops:g} TFLOP/s peak at {hw.mfu:.0%} MFU. Options: --memory-headroom "
        "--intra-node-gbps --inter-node-gbps --device-tflops --mfu."
    )
    table = Table()
    for column in PLAN_COLUMNS:
        table.add_column(column.header, justify="left" if column.left else "right", no_wrap=True)
    for e in estimates:
        values = e.as_dict()
        cells = [column.cell(*(values[field] for field in column.fields)) for column in PLAN_COLUMNS]
        if e is best:
            cells[[column.header for column in PLAN_COLUMNS].index("fits")] = "[bold green]<- best[/]"
        table.add_row(*cells)
    console.print(table)
    console.print(
        "peak: parameters, gradients and optimizer state + activations + FSDP's gathered buffers. Each part, the "
        "traffic\nper axis and the data-parallel size of every row: --json."
    )
    if best is not None:
        reason = f"recommended: {layout(best)}: {reason}"
    console.print(reason)
    return 0 if best else 1
