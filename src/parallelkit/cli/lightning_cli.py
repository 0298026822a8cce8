"""`parallelkit fit/validate/test/predict`: LightningCLI with parallelkit's defaults, its refusals before launch,
and its parse errors as one paragraph."""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from functools import update_wrapper
from pathlib import Path
from types import MethodType
from typing import Any

import yaml
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from parallelkit.checkpoint import CheckpointError, check_readable
from parallelkit.cli.config import read_config
from parallelkit.compat import parser_keys
from parallelkit.errors import ConfigError, ParallelkitError
from parallelkit.init import meta_parameters
from parallelkit.mesh import data_parallel_size
from parallelkit.optimizers.muon import Muon


class ParallelkitCLI(LightningCLI):
    """LightningCLI with parallelkit's defaults: model and datamodule given by class_path in the config, any
    registered strategy name accepted, and the saved config overwritten on re-runs (it is a record)."""

    def __init__(self, args: Sequence[str] | None = None, **kwargs: object) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # A parse error raises (`parse_arguments` makes it one paragraph) instead of printing the whole usage.
        kwargs.setdefault(
            "parser_kwargs", {"description": "parallelkit: distributed training on Lightning.", "exit_on_error": False}
        )
        argv = list(sys.argv[1:] if args is None else args)
        self._asked = argv[0] if argv and argv[0] in LightningCLI.subcommands() else None
        super().__init__(
            model_class=None,
            datamodule_class=None,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            **kwargs,
        )

    @override
    def subcommands(self) -> dict[str, set[str]]:
        """The subcommand the command line names, or all four when it names none (`parallelkit --help`).

        LightningCLI builds a parser per subcommand, each with every Trainer, model and data argument, before it
        parses: three quarters of that work went to parsers the command does not use, in every process of every run
        (Lightning's launcher re-runs the command line in each rank)."""
        every = LightningCLI.subcommands()
        return {self._asked: every[self._asked]} if self._asked else every

    @override
    def _add_configure_optimizers_method_to_model(self, subcommand: str | None) -> None:
        """`--optimizer`/`--lr_scheduler` from the command line, rebound to the parameters the model has when the
        strategy asks for its optimizers.

        LightningCLI builds that optimizer here, from the model as constructed; parallelkit strategies then
        replace parameters (FSDP and TP make DTensors, a pipeline stage drops other stages' layers), and an
        optimizer left holding the originals would step tensors the model no longer uses. Parameters are
        matched by name, which sharding keeps.
        """
        _muon_for_torchs(self.config_init.get(str(subcommand), self.config_init))
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
            if isinstance(optimizer, Muon):
                optimizer.split(module)  # which parameters are matrices, by name (under any strategy)
            return configure(module)

        update_wrapper(rebound, configure)  # Lightning's is_overridden() reads the wrapped function
        self.model.configure_optimizers = MethodType(rebound, self.model)

    @override
    def _dump_config(self) -> None:
        """The config as plain data, from which Lightning takes the model's and datamodule's hyperparameters: as
        LightningCLI dumps it, less its second validation of what `parse_arguments` has just validated, a sixth of
        the parse that every rank of every run makes (Lightning's launcher re-runs the command line per rank)."""
        if hasattr(self, "config_dump"):
            return
        dumped = self.parser.dump(
            self.config, skip_link_targets=False, skip_unset=False, skip_validation=True, format="yaml"
        )
        self.config_dump = yaml.safe_load(dumped)
        if "subcommand" in self.config:
            self.config_dump = self.config_dump[self.config.subcommand]

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
        expanded = strategy_name_as_class(torch_muon_as_ours(argv))
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
            check_launch(self.model, data_parallel_size(self.trainer.strategy), self.trainer)
        ckpt_path = self.config_init[self.subcommand].get("ckpt_path")
        sharded = isinstance(ckpt_path, str) and (Path(ckpt_path) / ".metadata").is_file()
        if sharded and not isinstance(self.trainer.strategy, ParallelkitStrategy):
            raise CheckpointError(
                f"{ckpt_path} is a sharded checkpoint, which strategy {type(self.trainer.strategy).__name__} cannot "
                "load. Resume it with a parallelkit strategy (one process too: --trainer.strategy=fsdp_tp "
                "--trainer.devices=1), or take its weights with: parallelkit consolidate CKPT_DIR OUT.pt"
            )
        from parallelkit.callbacks.preemption import CTRL_C
        from parallelkit.loggers import continue_logged_run

        CTRL_C.trainer = self.trainer  # Ctrl-C before training also ends the ranks this process's launcher starts
        if self.subcommand == "fit":
            continue_logged_run(self.trainer, ckpt_path)  # a resume logs on in the saving run's version directory

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
        elif arg == "--trainer.strategy" and index + 1 < first:  # the name as the next argument
            at, name = index, args[index + 1]
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
    if at is None:
        return [*args[:first], *named, *args[first:]]
    return [*args[:at], *named, *args[at + (1 if "=" in args[at] else 2) :]]


def parse_error(message: str, parser: Any, args: Sequence[str]) -> ConfigError:
    """jsonargparse's parse error as one paragraph: the key it does not know, the closest it does and the fix, or
    its own message on one line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    run = args[0] if args and not args[0].startswith("-") else "fit"  # the subcommand whose --help to point at
    unknown = re.search(r"does not accept options? '([^']+)'", message) or re.search(
        r"unrecognized arguments: (--)?([\w.]+)", message, re.IGNORECASE
    )
    option = re.search(r"Option '([^']+)' is not accepted", message)
    if option:
        key = re.search(r'Parser key "([^"]+)"', message)
        owner = re.search(r"class_path '([^']+)'", message)
        field = f"{key.group(1)}.init_args.{option.group(1)}" if key else option.group(1)
        accepted = _init_options(owner.group(1)) if owner else []
        close = difflib.get_close_matches(option.group(1), accepted, n=1)
        named = f"{owner.group(1)} " if owner else ""
        if owner and owner.group(1) == "torch.optim.Muon" and option.group(1) in _init_options("parallelkit.Muon"):
            return ConfigError(
                f"{field} is an option of parallelkit.Muon, which runs torch.optim.Muon, not of torch.optim.Muon "
                "itself, which a config file names. Fix: class_path: parallelkit.Muon in the config (on the command "
                "line, --optimizer=torch.optim.Muon takes it)."
            )
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
            f"{key} is not an option parallelkit's {run} knows."
            f"{f' Did you mean {close[0]!r}?' if close else ''} Fix: rename the key in the config or on the command "
            f"line (`parallelkit {run} --help` lists the options)."
        )
    return ConfigError(f"{' '.join(lines)} Fix: `parallelkit {run} --help` lists the options and their types.")


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


def torch_muon_as_ours(args: list[str]) -> list[str]:
    """`args` with `--optimizer=torch.optim.Muon` (or `--optimizer torch.optim.Muon`, `--optimizer.class_path=...`)
    naming `parallelkit.Muon`, which runs it (`_muon_for_torchs`), before jsonargparse reads the options that follow
    against a class: parallelkit's own (`adamw_lr`, ...) are then accepted with torch's name too."""
    swapped = list(args)
    for index, arg in enumerate(args):
        if arg in ("--optimizer=torch.optim.Muon", "--optimizer.class_path=torch.optim.Muon"):
            swapped[index] = arg.replace("torch.optim.Muon", "parallelkit.Muon")
        elif arg in ("--optimizer", "--optimizer.class_path") and args[index + 1 : index + 2] == ["torch.optim.Muon"]:
            swapped[index + 1] = "parallelkit.Muon"
    if swapped != args:
        rank_zero_info(MUON_AS_OURS)
    return swapped


MUON_AS_OURS = (
    "--optimizer=torch.optim.Muon: parallelkit.Muon runs it on the hidden matrices (linear layers' weights but the "
    "output layer's, experts per expert, LoRA adapters) and AdamW on the rest."
)


def _muon_for_torchs(config: Any) -> None:
    """`--optimizer=torch.optim.Muon` runs as `parallelkit.Muon`: torch's takes 2-D parameters alone (it refuses a
    model's norms and biases), parallelkit's runs torch's Muon on the hidden matrices and AdamW on the rest, with the
    same arguments."""
    optimizer = config.get("optimizer") if hasattr(config, "get") else None
    if optimizer is not None and getattr(optimizer, "class_path", None) == "torch.optim.Muon":
        optimizer.class_path = "parallelkit.Muon"
        rank_zero_info(MUON_AS_OURS)
