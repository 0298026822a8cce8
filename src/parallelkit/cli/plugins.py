"""`parallelkit plugins`: every strategy and comm hook found through entry points."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from parallelkit import plugins


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
