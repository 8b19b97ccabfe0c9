"""Command lines built from config dataclasses, with TOML/JSON run files.

A training script describes its options once, as a dataclass whose fields carry
their help text (:func:`option`). :func:`parse_config` turns that into

* an ``argparse`` parser: ``--field-name`` per field, typed from the annotation
  (``int``, ``float``, ``str``, ``bool`` as ``--x/--no-x``, ``Literal`` as
  choices, ``list[int]`` as several values, ``X | None``);
* ``--config run.toml`` (or ``.json``): a file of ``field = value`` pairs
  (dashes or underscores), unknown keys rejected by name;

with the precedence ``defaults < config file < command line``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

T = TypeVar("T")


def option(default: Any = dataclasses.MISSING, *, help: str, **kw: Any) -> Any:  # noqa: A002
    """A dataclass field with help text for the command line."""
    if isinstance(default, list):
        value = list(default)
        kw["default_factory"] = lambda: list(value)
        default = dataclasses.MISSING
    return dataclasses.field(default=default, metadata={"help": help}, **kw)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _add_field(p: argparse.ArgumentParser, f: dataclasses.Field[Any], tp: Any) -> None:
    flag = "--" + f.name.replace("_", "-")
    help_text = f.metadata.get("help", "")
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        default = None
    help_text = f"{help_text} (default: {default!r})" if help_text else f"default: {default!r}"
    base, optional = _unwrap_optional(tp)
    kw: dict[str, Any] = {"dest": f.name, "help": help_text, "default": argparse.SUPPRESS}
    if base is bool:
        p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
    elif get_origin(base) is Literal:
        choices = list(get_args(base))
        p.add_argument(flag, choices=choices, type=type(choices[0]), **kw)
    elif get_origin(base) is list:
        (item,) = get_args(base)
        p.add_argument(flag, nargs="+", type=item, **kw)
    elif base in (int, float, str):
        p.add_argument(flag, type=base, metavar=base.__name__.upper(), **kw)
    else:
        raise TypeError(f"option {f.name!r}: unsupported type {tp!r} for the command line")
    del optional  # None comes from the default or a config file; the flag takes a value


def build_parser(cls: type, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--config",
        default=None,
        help="a TOML or JSON file of option = value pairs; command-line options override it",
    )
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        _add_field(p, f, hints[f.name])
    return p


def load_config_file(path: str | Path, cls: type) -> dict[str, Any]:
    """``path`` (TOML or JSON) -> ``{field: value}``, keys checked against ``cls``."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {p} does not exist")
    if p.suffix == ".toml":
        with open(p, "rb") as fh:
            raw = tomllib.load(fh)
    elif p.suffix == ".json":
        raw = json.loads(p.read_text(encoding="utf-8"))
    else:
        raise ValueError(f"config file {p}: expected a .toml or .json file, got {p.suffix!r}")
    if not isinstance(raw, dict):
        raise ValueError(f"config file {p}: expected a table of options, got {type(raw).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(
                f"config file {p}: unknown option {key!r}; known options: {sorted(known)}"
            )
        out[name] = value
    return out


def parse_config(cls: type[T], argv: list[str] | None, description: str) -> T:
    """Defaults, then ``--config`` file values, then command-line values -> ``cls(...)``."""
    args = vars(build_parser(cls, description).parse_args(argv))
    path = args.pop("config")
    values = load_config_file(path, cls) if path else {}
    values.update(args)  # only options given on the command line (defaults are SUPPRESSed)
    return cls(**values)


def config_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-able dict of a config dataclass (for metrics and checkpoints)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items()}
