"""Config files and overrides as plain data: reading TOML, ``--section.key=value`` overrides, merging
them, and writing a resolved config back as TOML (what :mod:`lmforge.config` validates)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from lmforge.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``--training.steps=50`` / ``--training.steps 50`` into a nested dict.

    Values are read as TOML literals (numbers, booleans, strings in quotes, arrays) and fall back to
    plain strings, so ``--run.dir=runs/x`` needs no quoting.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.key=value")
        body = arg[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{body} has no value: write --{body}=VALUE")
            key, raw = body, args[i + 1]
            i += 1
        i += 1
        key = key.replace("-", "_")
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{key} conflicts with another override")
        node[parts[-1]] = _parse_value(raw)
    return out

def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw

def merge_config(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` over ``base``; an override into a key the file gives a non-table value keeps the file's
    value, so validation still reports it (e.g. ``training = [1, 2]`` plus ``--training.steps=5``)."""
    merged = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = merge_config(merged[k], v)
        elif isinstance(v, dict) and k in merged:
            continue
        else:
            merged[k] = v
    return merged

def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: config file is not UTF-8 text") from None

def _toml_value(v: Any) -> str:
    """JSON scalars and arrays are TOML too; tables (``data.sources`` entries) are written inline."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v)

def dump_toml(data: dict[str, Any]) -> str:
    """Write a two-level config dict as TOML (tables of scalars/arrays; ``None`` values omitted)."""
    lines: list[str] = []
    for section, values in data.items():
        if not isinstance(values, dict):
            if values is not None:
                lines.append(f"{section} = {json.dumps(values)}")
            continue
        lines.append(f"\n[{section}]")
        for k, v in values.items():
            if v is not None:
                lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines).lstrip() + "\n"
