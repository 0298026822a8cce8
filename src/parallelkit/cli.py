"""The `parallelkit` command: LightningCLI's fit/validate/test/predict, plus the `env` and `plugins` tools.

parallelkit fit --config configs/ddp.yaml --trainer.max_steps=20
parallelkit env --mesh '[[2, 2], ["fsdp", "tp"]]' --devices 4
parallelkit plugins

Over 400 lines: the LightningCLI subclass and the tools (`env`, `plugins`, `consolidate`, `export-hf`, `plan`,
`check`) share its config reading and error reporting (`main`).
"""

from __future__ import annotations

import argparse
import difflib
import gc
import json
import os
import platform
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from functools import update_wrapper
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import MethodType
from typing import Any

import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_only
from rich.console import Console
from rich.table import Table
from typing_extensions import override

import parallelkit
from parallelkit import plugins
from parallelkit.checkpoint import CheckpointError, check_readable, consolidate
from parallelkit.compat import lightning_quiet_about_precision, parser_keys
from parallelkit.errors import ConfigError, ParallelkitError
from parallelkit.init import meta_parameters
from parallelkit.mesh import MeshSpec
from parallelkit.planner import gb

TOOLS_HELP = """\
tools (no model, no training):
  parallelkit env [--mesh SHAPE --devices N]   versions, backends, devices, launcher env, a mesh's rank layout
  parallelkit plugins                          every discovered strategy and comm hook, and load errors
  parallelkit consolidate CKPT_DIR OUT.pt      a sharded checkpoint's weights as one plain state dict
  parallelkit export-hf CKPT OUT_DIR           an HFCausalLM checkpoint as a Hugging Face model directory
                                               (--adapters: a LoRA run's adapters in PEFT's format; a non-empty
                                               OUT_DIR only with --overwrite, which keeps files it does not write)
  parallelkit plan --config RUN.yaml --nodes N --devices-per-node G --device-memory 80GB
                                               every valid mesh's memory and communication, and a recommendation
  parallelkit check --config RUN.yaml          launched as fit: every rank's device and versions, collectives per
                                               mesh axis with deadlines (--dry-run --nodes N --devices-per-node G:
                                               the real plan applied in one process with a fake process group)
"""


class ParallelkitCLI(LightningCLI):
    """LightningCLI with parallelkit's defaults: model and datamodule given by class_path in the config, any
    registered strategy name accepted, and the saved config overwritten on re-runs (it is a record)."""

    def __init__(self, args: Sequence[str] | None = None, **kwargs: object) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # A parse error raises (`parse_arguments` makes it one paragraph) instead of printing the whole usage.
        kwargs.setdefault(
            "parser_kwargs", {"description": "parallelkit: distributed training on Lightning.", "exit_on_error": False}
        )
        super().__init__(
            model_class=None,
            datamodule_class=None,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            **kwargs,
        )

    @override
    def _add_configure_optimizers_method_to_model(self, subcommand: str | None) -> None:
        """`--optimizer`/`--lr_scheduler` from the command line, rebound to the parameters the model has when the
        strategy asks for its optimizers.

        LightningCLI builds that optimizer here, from the model as constructed; parallelkit strategies then
        replace parameters (FSDP and TP make DTensors, a pipeline stage drops other stages' layers), and an
        optimizer left holding the originals would step tensors the model no longer uses. Parameters are
        matched by name, which sharding keeps.
        """
        super()._add_configure_optimizers_method_to_model(subcommand)
        configure = getattr(self.model.configure_optimizers, "__func__", None)
        optimizer = getattr(configure, "keywords", {}).get("optimizer")
        if optimizer is None:
            return  # the model's own configure_optimizers, which runs after sharding anyway
        names = {id(param): name for name, param in self.model.named_parameters()}
        group_names = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]

        def rebound(module: object) -> object:
            current = dict(module.named_parameters())
            for group, wanted in zip(optimizer.param_groups, group_names):
                group["params"] = [current[name] for name in wanted if name in current]
            return configure(module)

        update_wrapper(rebound, configure)  # Lightning's is_overridden() reads the wrapped function
        self.model.configure_optimizers = MethodType(rebound, self.model)

    @override
    def instantiate_classes(self) -> None:
        """Build the config's objects; under a strategy with `meta_init: true`, the model's parameters on the meta
        device (the strategy allocates each rank's shards after sharding)."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        strategy = config["trainer"]["strategy"]
        meta = bool(getattr(getattr(strategy, "init_args", None), "meta_init", False))
        with meta_parameters() if meta else nullcontext():
            super().instantiate_classes()

    def _check_trainer_config(self) -> None:
        """Refuse what Lightning's Trainer would refuse with a traceback, or not at all: an unknown strategy name, a
        precision a parallelkit strategy does not run, fewer than one batch per optimizer step, and a checkpoint
        callback with checkpointing off."""
        from parallelkit.strategies import ParallelkitStrategy
        from parallelkit.strategies.base import ShardedPrecision

        config = self.config_init[self.subcommand]["trainer"]
        accumulate = config.get("accumulate_grad_batches")
        if isinstance(accumulate, int) and accumulate < 1:
            raise ConfigError(
                f"trainer.accumulate_grad_batches={accumulate}: the number of batches whose gradients make one "
                "optimizer step must be at least 1. Fix: 1 (a step per batch, the default) or more."
            )
        if config.get("enable_checkpointing") is False:
            from lightning.pytorch.callbacks import ModelCheckpoint

            saving = [c for c in config.get("callbacks") or [] if isinstance(c, ModelCheckpoint)]
            if saving:
                raise ConfigError(
                    f"trainer.enable_checkpointing=false, but trainer.callbacks holds a ModelCheckpoint (dirpath "
                    f"{saving[0].dirpath}): Lightning refuses the two together. Fix: to save nothing, drop the "
                    "config's callbacks with --trainer.callbacks=[] (or delete the ModelCheckpoint from the config); "
                    "to save, leave enable_checkpointing on."
                )
        strategy, precision = config.get("strategy"), config.get("precision")
        if isinstance(strategy, str):
            check_strategy_name(strategy)
        elif isinstance(strategy, ParallelkitStrategy) and precision is not None:
            # Lightning checks a ModelParallelStrategy instance's precision against its own list before the
            # strategy sees it, so ShardedPrecision's refusal would come too late.
            ShardedPrecision(PRECISION_ALIASES.get(str(precision), str(precision)))

    @override
    def instantiate_trainer(self, **kwargs: object) -> object:
        """The Trainer, showing parallelkit's progress bar and model summary (`parallelkit.callbacks.display`)
        unless the config brings its own or turns them off, and saying on Ctrl-C how to resume (`InterruptNotice`)."""
        from lightning.pytorch.callbacks import ModelSummary as AnyModelSummary
        from lightning.pytorch.callbacks import ProgressBar as AnyProgressBar

        from parallelkit.callbacks.display import ModelSummary, ProgressBar
        from parallelkit.callbacks.preemption import InterruptNotice

        self._check_trainer_config()
        config = self.config_init[self.subcommand]["trainer"]
        callbacks = [*(config.get("callbacks") or []), InterruptNotice(sys.argv[1:])]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, AnyProgressBar) for c in callbacks):
            callbacks.append(ProgressBar())
        if config.get("enable_model_summary") is not False and not any(
            isinstance(c, AnyModelSummary) for c in callbacks
        ):
            callbacks.append(ModelSummary())
            # The switch adds Lightning's default summary, or says at length that it skipped it for ours.
            kwargs.setdefault("enable_model_summary", False)
        return super().instantiate_trainer(**{"callbacks": callbacks, **kwargs})

    @override
    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Parse (a registered strategy name taking its class's options: `strategy_name_as_class`; a mistake as one
        paragraph: `parse_error`), then refuse a --ckpt_path that is not a checkpoint to resume from, before launch
        (so in one process, not every rank) and before LightningCLI reads a checkpoint file's hyperparameters."""
        argv = list(sys.argv[1:] if args is None else args)
        expanded = strategy_name_as_class(argv)
        try:
            with warnings.catch_warnings():  # "args and command line arguments": ours are sys.argv's, expanded
                warnings.filterwarnings("ignore", message=".*args parameter is intended to run from within Python")
                super().parse_arguments(parser, args if expanded == argv else expanded)
        except argparse.ArgumentError as err:
            raise parse_error(str(err), parser, argv) from None
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if isinstance(ckpt_path, str) and ckpt_path not in ("last", "best", "hpc", "registry") and ":" not in ckpt_path:
            check_readable(Path(ckpt_path))  # names Lightning resolves itself, URLs and registry:<name> are left to it

    def _before_launch(self) -> None:
        """Refuse, in this one process before any worker starts: a model the strategy's layout cannot split, data
        whose ids cannot be the model's (the datamodule's `check_model`) or too little of it for the run
        (`check_launch`), and a sharded checkpoint under a strategy that cannot load it (instead of failing in
        torch.load)."""
        from parallelkit.strategies import ParallelkitStrategy

        if isinstance(self.trainer.strategy, ParallelkitStrategy):
            self.trainer.strategy.check_run(self.model, self.datamodule, self.trainer.accumulate_grad_batches)
        check_data = getattr(self.datamodule, "check_model", None)
        if callable(check_data):
            check_data(self.model)
        check_launch = getattr(self.datamodule, "check_launch", None)
        environment = getattr(self.trainer.strategy, "cluster_environment", None)
        # Under torchrun or SLURM every rank runs this: the ranks check their data themselves, once it is prepared.
        launching = not getattr(environment, "creates_processes_externally", False)
        if self.subcommand == "fit" and callable(check_launch) and launching:
            strategy = self.trainer.strategy
            replicas = (
                strategy.mesh_spec.dp_size
                if isinstance(strategy, ParallelkitStrategy)
                else self.trainer.num_devices * self.trainer.num_nodes
            )
            check_launch(self.model, replicas, self.trainer)
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        sharded = isinstance(ckpt_path, str) and (Path(ckpt_path) / ".metadata").is_file()
        if sharded and not isinstance(self.trainer.strategy, ParallelkitStrategy):
            raise CheckpointError(
                f"{ckpt_path} is a sharded checkpoint, which strategy {type(self.trainer.strategy).__name__} cannot "
                "load. Resume it with a parallelkit strategy (one process too: --trainer.strategy=fsdp_tp "
                "--trainer.devices=1), or take its weights with: parallelkit consolidate CKPT_DIR OUT.pt"
            )

    before_fit = before_validate = before_test = before_predict = _before_launch


def strategy_name_as_class(args: list[str]) -> list[str]:
    """`args` with a registered strategy name that options follow (`--trainer.strategy=fsdp_tp
    --trainer.strategy.mesh_shape=...`, or a config's `strategy: fsdp_tp` and such options) given as its class and
    registered arguments: jsonargparse applies options to a class, not to a name."""
    first = next((i for i, arg in enumerate(args) if arg.startswith("--trainer.strategy.")), None)
    if first is None:
        return args
    at, name = None, None
    for index, arg in enumerate(args[:first]):
        if arg.startswith("--trainer.strategy="):
            at, name = index, arg.split("=", 1)[1]
        elif arg in ("--config", "-c") or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else args[index + 1] if index + 1 < first else None
            try:
                strategy = (read_config(path).get("trainer") or {}).get("strategy") if path else None
            except ParallelkitError:
                strategy = None  # inline YAML, or a file `main` names
            if strategy is not None:
                at, name = None, strategy
    if not isinstance(name, str) or name.lower() not in StrategyRegistry:
        return args
    entry = StrategyRegistry[name.lower()]  # (its `get` builds the strategy)
    cls = entry["strategy"]
    try:
        spec = json.dumps({"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": entry["init_params"]})
    except TypeError:  # arguments JSON cannot carry: left to the name
        return args
    # "auto" first: a class given after another class keeps the arguments the two share; a name starts afresh.
    named = ["--trainer.strategy=auto", f"--trainer.strategy={spec}"]
    return [*args[:at], *named, *args[at + 1 :]] if at is not None else [*args[:first], *named, *args[first:]]


def parse_error(message: str, parser: Any, args: Sequence[str]) -> ConfigError:
    """jsonargparse's parse error as one paragraph: the key it does not know, the closest it does and the fix, or
    its own message on one line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    unknown = re.search(r"does not accept options? '([^']+)'", message) or re.search(
        r"Unrecognized arguments: (--)?([\w.]+)", message
    )
    option = re.search(r"Option '([^']+)' is not accepted", message)
    if option:
        key = re.search(r'Parser key "([^"]+)"', message)
        owner = re.search(r"class_path '([^']+)'", message)
        field = f"{key.group(1)}.init_args.{option.group(1)}" if key else option.group(1)
        accepted = _init_options(owner.group(1)) if owner else []
        close = difflib.get_close_matches(option.group(1), accepted, n=1)
        named = f"{owner.group(1)} " if owner else ""
        return ConfigError(
            f"{field} is not an option of {named or 'its class '}(it takes {', '.join(accepted) or 'no options'})."
            f"{f' Did you mean {close[0]!r}?' if close else ''} Fix: rename the key in the config or on the command "
            "line."
        )
    if unknown:
        key = unknown.group(unknown.lastindex)
        section = key.rpartition(".")[0]
        known = parser_keys(parser, args[0] if args else None)
        siblings = [k for k in known if k.rpartition(".")[0] == section] or known
        close = difflib.get_close_matches(key, siblings, n=1)
        return ConfigError(
            f"{key} is not an option parallelkit's {args[0] if args else 'fit'} knows."
            f"{f' Did you mean {close[0]!r}?' if close else ''} Fix: rename the key in the config or on the command "
            f"line (`parallelkit {args[0] if args else 'fit'} --help` lists the options)."
        )
    return ConfigError(f"{' '.join(lines)} Fix: `parallelkit fit --help` lists the options and their types.")


def _init_options(class_path: str) -> list[str]:
    """The keyword arguments `class_path`'s constructor takes (empty when it cannot be imported)."""
    import importlib
    import inspect

    module, _, name = class_path.rpartition(".")
    try:
        signature = inspect.signature(getattr(importlib.import_module(module), name))
    except (ImportError, AttributeError, ValueError, TypeError):
        return []
    return [p.name for p in signature.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


PRECISION_ALIASES = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}
"""Lightning's short precision names (and ints), as the names it converts them to."""


def check_strategy_name(name: str) -> None:
    """Raise a ConfigError, listing the registered names and the closest, unless `name` is one."""
    names = ["auto", *sorted(StrategyRegistry.available_strategies())]
    if name.lower() in names:
        return
    close = difflib.get_close_matches(name.lower(), names, n=1)
    raise ConfigError(
        f"trainer.strategy={name!r} is not a registered strategy name.{f' Did you mean {close[0]!r}?' if close else ''}"
        f" Registered (Lightning's, parallelkit's and installed plugins'): {', '.join(names)}. Fix: one of these "
        "names, or a class_path; `parallelkit plugins` lists plugins that failed to load."
    )


def read_config(path: str) -> dict[str, Any]:
    """A YAML config file's contents; a ConfigError names the file (and where a syntax error is)."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(
            f"--config {path} cannot be read: {err.strerror}. Fix: the path of a YAML file, e.g. configs/hybrid.yaml."
        ) from err
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = "; ".join(p for p in (getattr(err, "context", None), getattr(err, "problem", None)) if p) or str(err)
        raise ConfigError(
            f"--config {path} is not valid YAML{where}: {what}. Fix the YAML there (indentation, a ':' after each "
            "key, closing brackets and quotes)."
        ) from err


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


def plugins_command(argv: Sequence[str]) -> int:
    """List every strategy and comm hook found through entry points, where it comes from, and load errors."""
    parser = argparse.ArgumentParser(prog="parallelkit plugins", description=plugins_command.__doc__)
    parser.parse_args(argv)
    table = Table(title="parallelkit plugins")
    for column in ("group", "name", "target", "distribution", "status"):
        table.add_column(column)
    plugins.activate()  # registers the strategies: name clashes show as errors
    plugins.comm_hooks()  # settles comm hook name clashes so they show as errors
    for group in plugins.GROUPS:
        for plugin in plugins.discover(group):
            status = f"[red]error: {plugin.error}[/red]" if plugin.error else "ok"
            table.add_row(group.split(".")[-1], plugin.name, plugin.target, plugin.origin, status)
    Console(width=200).print(table)
    return 0


def consolidate_command(argv: Sequence[str]) -> int:
    """Write a sharded (DCP) checkpoint's model weights as one state dict that the unparallelised model loads."""
    parser = argparse.ArgumentParser(prog="parallelkit consolidate", description=consolidate_command.__doc__)
    parser.add_argument("checkpoint", help="checkpoint directory written by a parallelkit strategy")
    parser.add_argument("out", help="file to write (torch.save of {parameter name: tensor})")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists (default: refuse)")
    args = parser.parse_args(argv)
    out = consolidate(args.checkpoint, args.out, overwrite=args.overwrite)
    print(f"wrote {out}: load it with model.load_state_dict(torch.load({str(out)!r}, weights_only=True))")
    return 0


def export_hf_command(argv: Sequence[str]) -> int:
    """Write an HFCausalLM checkpoint as a Hugging Face model directory (config.json, safetensors, tokenizer)."""
    from parallelkit.models.hf_io import export_hf

    parser = argparse.ArgumentParser(prog="parallelkit export-hf", description=export_hf_command.__doc__)
    parser.add_argument("checkpoint", help="a checkpoint of parallelkit.models.HFCausalLM (sharded directory or file)")
    parser.add_argument("out", help="the directory to write; AutoModelForCausalLM.from_pretrained(OUT) loads it")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB (default)")
    parser.add_argument("--tokenizer", help="copy tokenizer files from here (default: the pretrained directory)")
    parser.add_argument(
        "--adapters",
        action="store_true",
        help="a LoRA run's adapters alone, in PEFT's format (default: merged into the base weights)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty OUT, replacing the files an export writes and keeping the rest (default: refuse)",
    )
    args = parser.parse_args(argv)
    size = _bytes(args.max_shard_size, "--max-shard-size")
    out = export_hf(args.checkpoint, args.out, size, args.tokenizer, adapters=args.adapters, overwrite=args.overwrite)
    if args.adapters:
        print(f"wrote {out}: load it with peft.PeftModel.from_pretrained(base_model, {str(out)!r})")
    else:
        print(f"wrote {out}: load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def _bytes(text: str, flag: str = "--device-memory") -> float:
    units = {"tb": 1e12, "gb": 1e9, "mb": 1e6, "kb": 1e3, "tib": 2**40, "gib": 2**30, "mib": 2**20, "kib": 2**10}
    lowered = text.strip().lower()
    unit = next((u for u in sorted(units, key=len, reverse=True) if lowered.endswith(u)), "")
    try:
        size = float(lowered[: len(lowered) - len(unit)]) * units.get(unit, 1)
    except ValueError:
        size = None
    if size is None or not size > 0:
        raise ConfigError(
            f"{flag} {text!r} is not a size. Fix: a positive number of bytes or a number with a unit, e.g. 80GB or "
            "24GiB (units: TB, GB, MB, KB, TiB, GiB, MiB, KiB)."
        )
    return size


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


class _PlanCLI(ParallelkitCLI):
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
    read_config(args.config)  # a missing or broken file named as `fit` names it (jsonargparse's errors do not)
    cli = _PlanCLI(args.config, overrides)
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
        _bytes(args.device_memory),
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


CHECK_TRAINER_KEYS = ("accelerator", "strategy", "devices", "num_nodes", "precision", "plugins")
"""The Trainer arguments `check` builds the run's Trainer from: processes, devices and layout, not training."""


def check_command(argv: Sequence[str]) -> int:
    """Test the run's layout on its cluster, launched as `fit` is (`parallelkit.check`): every rank's device and
    versions, collectives per mesh axis with deadlines; or, `--dry-run`, its plan applied per rank in this process."""
    from lightning.pytorch import Trainer

    from parallelkit.check import Options, launch
    from parallelkit.check.dry_run import dry_run

    parser = argparse.ArgumentParser(prog="parallelkit check", description=check_command.__doc__)
    parser.add_argument("--config", required=True, help="the run's YAML, as for `fit`")
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds a collective may take (default: 60)")
    parser.add_argument(
        "--join-deadline", type=float, default=300.0, help="seconds the ranks may take to start and meet (default: 300)"
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
        help="dry run: memory per device a mesh_shape=auto is planned against, e.g. 80GB (default: this machine's)",
    )
    parser.epilog = "Other options are fit's overrides of the config, e.g. --trainer.devices=8."
    args, overrides = parser.parse_known_args(argv)
    read_config(args.config)
    if min(args.deadline, args.join_deadline) <= 0 or args.iters < 1:
        raise ConfigError(
            f"--deadline {args.deadline:g} --join-deadline {args.join_deadline:g} --iters {args.iters}: deadlines are "
            "positive seconds and the repetitions at least 1. Fix: e.g. --deadline 60 --join-deadline 300 --iters 5."
        )
    sizes = tuple(int(_bytes(size, "--sizes")) for size in args.sizes.split(","))
    if args.dry_run:  # the cluster's nodes and devices, on this machine's CPU
        overrides = [*overrides, "--trainer.accelerator=cpu"]
        overrides += [f"--trainer.num_nodes={args.nodes}"] if args.nodes else []
        overrides += [f"--trainer.devices={args.devices_per_node}"] if args.devices_per_node else []
    cli = _PlanCLI(args.config, overrides)  # the model on the meta device
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
        if args.device_memory is not None and hasattr(trainer.strategy, "device_memory"):
            trainer.strategy.device_memory = _bytes(args.device_memory)
        return dry_run(trainer, cli.model, cli.datamodule, args.rank, args.json)
    options = Options(args.deadline, args.join_deadline, sizes, args.iters, args.allow_mixed, args.json)
    return launch(trainer, cli.model, cli.datamodule, options)


TOOLS: dict[str, Callable[[Sequence[str]], int]] = {
    "env": env_command,
    "plugins": plugins_command,
    "consolidate": consolidate_command,
    "export-hf": export_hf_command,
    "plan": plan_command,
    "check": check_command,
}


REPORT_GRACE_S = 10.0
"""How long a rank other than 0 waits for rank 0 to report the error they both met before reporting its own."""


def report(err: ParallelkitError, launcher_pid: int) -> None:
    """Print `err` as parallelkit's one-paragraph error on stderr, once per job.

    An error after launch (planning the model, the first batch) usually stops every rank at the same point. Global
    rank 0 reports it. Lightning's launcher started ranks 1..N-1 as rank 0's children (`launcher_pid`: the parent
    when this process started), and torchrun ends every rank once one fails: another rank stays silent if rank 0 ends
    within the grace period, and reports its own error otherwise (one rank 0 did not meet).
    """
    if rank_zero_only.rank and rank_zero_ended(launcher_pid):
        return
    print(f"parallelkit: error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)


def rank_zero_ended(launcher_pid: int) -> bool:
    """On a rank Lightning's launcher started as rank 0's child: whether rank 0 (the parent, `launcher_pid`) ends
    within REPORT_GRACE_S."""
    deadline = time.monotonic() + REPORT_GRACE_S
    while os.getppid() == launcher_pid and time.monotonic() < deadline:
        time.sleep(0.1)
    return os.getppid() != launcher_pid


def _config_files(args: Sequence[str]) -> list[str]:
    """The files given to `--config`/`-c`: those that exist, and those named like a config file that do not
    (jsonargparse also takes inline YAML there, and reports a missing file inside a screen of usage)."""
    paths = [b for a, b in zip(args, args[1:]) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in args if a.startswith("--config=")]
    return [p for p in paths if Path(p).is_file() or p.endswith((".yaml", ".yml", ".json"))]


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the `parallelkit` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    launcher_pid = os.getppid()
    try:
        if args and args[0] in TOOLS:
            sys.exit(TOOLS[args[0]](args[1:]))
        if not args or args[0] in ("-h", "--help"):
            print(TOOLS_HELP)
        for path in _config_files(args):
            read_config(path)  # jsonargparse's YAML errors do not name the file
        # Lightning re-runs sys.argv for ranks 1..N-1, so the arguments must come from there unchanged.
        ParallelkitCLI(args=None if argv is None else args)
    except Exception as err:
        # jsonargparse raises a constructor's error (a model's or datamodule's argument check) from its own.
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, ParallelkitError):
            cause = cause.__cause__
        if cause is None:
            if rank_zero_only.rank and rank_zero_ended(launcher_pid):
                # Rank 0 failed alone (e.g. in prepare_data, which only it runs) and said why; this rank's error is
                # the consequence: a collective whose peer is gone.
                sys.exit(1)
            raise
        report(cause, launcher_pid)
        sys.exit(2)
    finally:
        if argv is None:  # run as the program: the process ends now
            # Interpreter shutdown's last garbage collection walks every object torch and Lightning created (about
            # a second of CPU per process, so ~3 s of a 4-process job on 2 cores) to free the few reference cycles
            # left, memory the exiting process returns anyway. It skips frozen objects; the rest of shutdown runs
            # as usual (atexit handlers, files closed, process groups destroyed).
            gc.freeze()


if __name__ == "__main__":
    main()
