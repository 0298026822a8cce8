"""`parallelkit check`: the run's layout tested on its cluster, or (`--dry-run`) its plan applied in one process."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from parallelkit.cli.config import parse_size, read_config
from parallelkit.cli.plan import MetaModelCLI
from parallelkit.compat import lightning_quiet_about_precision
from parallelkit.errors import ConfigError

CHECK_TRAINER_KEYS = ("accelerator", "strategy", "devices", "num_nodes", "precision", "plugins")
"""The Trainer arguments `check` builds the run's Trainer from: processes, devices and layout, not training."""


def check_command(argv: Sequence[str]) -> int:
    """Test the run's layout on its cluster, launched as `fit` is (`parallelkit.check`): every rank's device and
    versions, collectives per mesh axis with deadlines; or, `--dry-run`, its plan applied per rank in this process."""
    from lightning.pytorch import Trainer

    from parallelkit import plugins
    from parallelkit.check import Options, launch
    from parallelkit.check.dry_run import dry_run
    from parallelkit.cli.plan import memory_headroom
    from parallelkit.planner.records import MEMORY_HEADROOM

    parser = argparse.ArgumentParser(prog="parallelkit check", description=check_command.__doc__)
    parser.add_argument("--config", required=True, help="the run's YAML, as for `fit`")
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds a collective may take (default: 60)")
    parser.add_argument(
        "--join-deadline",
        type=float,
        default=300.0,
        help="seconds to wait for the next rank to join, counted again from each rank that does (default: 300)",
    )
    parser.add_argument("--sizes", default="64KiB,1MiB,16MiB", help="message sizes, comma-separated")
    parser.add_argument("--iters", type=int, default=5, help="timed repetitions of each collective")
    parser.add_argument("--allow-mixed", action="store_true", help="a cluster of mixed devices/versions is intended")
    parser.add_argument("--json", action="store_true", help="machine-readable output on rank 0")
    parser.add_argument("--dry-run", action="store_true", help="one process, a fake process group: apply the plan")
    parser.add_argument("--nodes", type=int, help="dry run: nodes of the cluster (default: the config's num_nodes)")
    parser.add_argument("--devices-per-node", type=int, help="dry run: devices per node (default: the config's)")
    parser.add_argument("--rank", default="0", help="dry run: the rank to build, a list, or 'all' (default: 0)")
    parser.add_argument(
        "--device-memory",
        help="dry run: memory per device, e.g. 80GB: what the planner's peak must fit, less --memory-headroom, and "
        "what a mesh_shape=auto is planned against (default: this machine's)",
    )
    parser.add_argument(
        "--memory-headroom",
        default=str(MEMORY_HEADROOM),
        help="dry run: memory of each device a layout must leave free, a share of --device-memory (0.1 or 10%%) or a "
        "size (8GB), as for `parallelkit plan` (default: %(default)s)",
    )
    parser.epilog = "Other options are fit's overrides of the config, e.g. --trainer.devices=8."
    args, overrides = parser.parse_known_args(argv)
    plugins.activate()  # strategies registered and known noise quieted before the model is built
    read_config(args.config)
    if min(args.deadline, args.join_deadline) <= 0 or args.iters < 1:
        raise ConfigError(
            f"--deadline {args.deadline:g} --join-deadline {args.join_deadline:g} --iters {args.iters}: deadlines are "
            "positive seconds and the repetitions at least 1. Fix: e.g. --deadline 60 --join-deadline 300 --iters 5."
        )
    sizes = tuple(int(parse_size(size, "--sizes")) for size in args.sizes.split(","))
    if args.dry_run:  # the cluster's nodes and devices, on this machine's CPU
        overrides = [*overrides, "--trainer.accelerator=cpu"]
        overrides += [f"--trainer.num_nodes={args.nodes}"] if args.nodes else []
        overrides += [f"--trainer.devices={args.devices_per_node}"] if args.devices_per_node else []
    cli = MetaModelCLI(args.config, overrides)  # the model on the meta device
    settings = dict(cli.config_init["trainer"])
    with lightning_quiet_about_precision():  # the check trains nothing
        trainer = Trainer(
            **{key: settings[key] for key in CHECK_TRAINER_KEYS if settings.get(key) is not None},
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
    if args.dry_run:
        memory = parse_size(args.device_memory) if args.device_memory is not None else None
        headroom = memory_headroom(args.memory_headroom, memory or float("inf"))
        if memory is not None and hasattr(trainer.strategy, "device_memory"):
            trainer.strategy.device_memory = memory
        if hasattr(trainer.strategy, "memory_headroom"):
            trainer.strategy.memory_headroom = headroom
        return dry_run(trainer, cli.model, cli.datamodule, args.rank, args.json, memory, headroom)
    options = Options(args.deadline, args.join_deadline, sizes, args.iters, args.allow_mixed, args.json)
    return launch(trainer, cli.model, cli.datamodule, options)
