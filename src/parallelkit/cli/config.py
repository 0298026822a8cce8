"""Reading what the user hands the command line: config files and sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from parallelkit.errors import ConfigError


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


def parse_size(text: str, flag: str = "--device-memory") -> float:
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
