"""`parallelkit plan`: every mesh's memory, communication and step time for a run, and a recommendation."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from typing_extensions import override

from parallelkit import plugins
from parallelkit.cli.config import parse_size, read_config
from parallelkit.cli.lightning_cli import ParallelkitCLI
from parallelkit.errors import ConfigError
from parallelkit.init import meta_parameters
from parallelkit.memory import gb

PLAN_COLUMNS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "mesh": ("mesh", str),
    "schedule": ("schedule", lambda schedule: schedule or "-"),
    "activation_checkpointing": ("act. ckpt", str),
    "micro_batch": ("micro-batch", str),
    "accumulate": ("accum.", str),
    "state": ("params+grads+optim", gb),
    "activations": ("activations", gb),
    "gathered": ("fsdp buffers", gb),
    "peak": ("peak", gb),
    "fits": ("fits", lambda fits: "yes" if fits else "[red]no[/]"),
    "comm": ("comm per step", lambda comm: ", ".join(f"{axis} {gb(b)}" for axis, b in comm.items()) or "-"),
    "step_s": ("est. step", lambda seconds: f"{seconds:.3g} s"),
    "tokens_per_s": ("tokens/s", lambda tokens: f"{tokens:,.0f}"),
}
"""`parallelkit plan`'s table: Estimate.as_dict() key -> (header, cell). One record, so a header cannot go missing."""

PLAN_TABLE_OMITS = {"params", "grads", "optimizer", "tensor_peak"}
"""Estimate.as_dict() keys the table leaves to --json: it shows their sum (params+grads+optim) and the peak."""


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


def plan_command(argv: Sequence[str]) -> int:
    """Estimate per-device memory, communication and step time of every mesh for a run, and recommend one."""
    import json
    from dataclasses import replace

    from parallelkit.planner import Hardware, layout, recommend, workload, workloads

    parser = argparse.ArgumentParser(prog="parallelkit plan", description=plan_command.__doc__)
    parser.add_argument("--config", required=True, help="the run's YAML (model, data, trainer as for `fit`)")

    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--devices-per-node", type=int, required=True)
    parser.add_argument("--device-memory", required=True, help="per device, e.g. 80GB or 24GiB")
    parser.add_argument("--seq-len", type=int, help="tokens per sample (default: data.init_args.seq_len)")
    parser.add_argument(
        "--micro-batch",
        type=int,
        help="samples per process per forward; default: every divisor of data.batch_size x accumulate_grad_batches "
        "is tried, the rest accumulated",
    )
    parser.add_argument(
        "--activation-checkpointing",
        type=lambda value: int(value) if value.isdigit() else value,
        help="none, full or n (every n-th block); default: none, every 2nd and full are tried",
    )
    parser.add_argument("--optimizer", choices=["adamw", "adam", "sgd_momentum", "sgd"], default="adamw")
    parser.add_argument("--intra-node-gbps", type=float, default=200.0, help="GB/s between devices of a node")
    parser.add_argument("--inter-node-gbps", type=float, default=25.0, help="GB/s between nodes")
    parser.add_argument("--device-tflops", type=float, default=400.0, help="peak dense TFLOP/s of one device")
    parser.add_argument("--no-pipeline", action="store_true", help="only fsdp/tp/hsdp meshes")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.epilog = "Other options are fit's overrides of the config, e.g. --model.init_args.n_layer=48."
    args, overrides = parser.parse_known_args(argv)
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
    if args.micro_batch:  # a pinned micro-batch: the config's samples per step are not spread over accumulation
        work = replace(work, accumulate=1)
    search = workloads(work, checkpointing=args.activation_checkpointing is None, micro_batch=not args.micro_batch)
    hw = Hardware(
        args.nodes,
        args.devices_per_node,
        parse_size(args.device_memory),
        args.intra_node_gbps,
        args.inter_node_gbps,
        args.device_tflops,
    )
    estimates, best, reason = recommend(model, work, hw, pipeline=not args.no_pipeline, search=search)
    if args.json:
        print(
            json.dumps(
                {
                    "workload": work.__dict__,
                    "hardware": hw.__dict__,
                    "estimates": [e.as_dict() for e in estimates],
                    "recommended": best.as_dict() if best else None,
                    "reason": reason,
                },
                indent=2,
            )
        )
        return 0 if best else 1
    params = sum(p.numel() for p in model.parameters())
    title = (
        f"{name}, {params / 1e9:.2f}B parameters, seq {work.seq_len} x {work.micro_batch * work.accumulate} samples "
        f"per process per step, on {args.nodes} x {args.devices_per_node} devices of {gb(hw.device_memory)}"
    )
    table = Table(title=title)
    for key, (header, _) in PLAN_COLUMNS.items():
        table.add_column(header, justify="left" if key in ("mesh", "schedule", "comm") else "right")
    for e in estimates:
        values = e.as_dict()
        cells = {key: text(values[key]) for key, (_, text) in PLAN_COLUMNS.items()}
        if e is best:
            cells["fits"] = "[bold green]<- recommended[/]"
        table.add_row(*cells.values())
    console = Console(width=250)
    console.print(table)
    if best is not None:
        reason = f"recommended: {layout(best)}: {reason}"
    console.print(reason)
    return 0 if best else 1
