"""Command lines built from config dataclasses, with TOML/JSON run files.

A training script describes its options once, as a dataclass whose fields carry
their help text (:func:`option`). :func:`parse_config` turns that into

* an ``argparse`` parser: ``--field-name`` per field, typed from the annotation
  (``int``, ``float``, ``str``, ``bool`` as ``--x/--no-x``, ``Literal`` as
  choices, ``list[int]`` as several values, ``X | None``);
* ``--config run.toml`` (or ``.json``): a file of ``field = value`` pairs
  (dashes or underscores), unknown keys rejected by name, every value checked
  against the field's type as strictly as the command line checks it (``512.0``
  or ``"512"`` is not an int; an int is a float);
* ``--debug``: a user error shows its full traceback (:mod:`hybridrec.cli.errors`);

with the precedence ``defaults < config file < command line``. Every mistake is a
:class:`ConfigError` (a ``ValueError``) on one line that names the option as the
user wrote it: the flag, and the key and file for a config file value. A
``ValueError`` from the dataclass's own checks gets its field names turned into
flags (``batch_size must be >= 1`` -> ``--batch-size must be >= 1``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import re
import sys
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar, get_args, get_origin

from hybridrec.cli.errors import show_tracebacks
from ps.redact import redact_values

T = TypeVar("T")

DEBUG_FLAG = "--debug"
_prog: ContextVar[str | None] = ContextVar("hybridrec_config_prog", default=None)


class ConfigError(ValueError):
    """A bad command-line option or config file value; the message names the option."""


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,  # noqa: A002
    old_names: tuple[str, ...] = (),
    **kw: Any,
) -> Any:
    """A dataclass field with help text for the command line. ``old_names``: earlier
    names of the option (fields' spelling, e.g. ``"steps"``), still taken on the command
    line and in config files with one line saying the new name (:func:`deprecated`),
    until the release after next."""
    if isinstance(default, list):
        value = list(default)
        kw["default_factory"] = lambda: list(value)
        default = dataclasses.MISSING
    metadata = {"help": help, "old_names": tuple(old_names)}
    return dataclasses.field(default=default, metadata=metadata, **kw)


def deprecated(old: str, new: str, where: str = "") -> None:
    """One line on stderr: ``old`` is now spelled ``new`` (flags or config keys)."""
    print(
        f"hybridrec: note: {where}{old} is now {new}; the old name still works in this "
        "release and will be removed in the next",
        file=sys.stderr,
        flush=True,
    )


class _OldName(argparse.Action):
    """An old flag of an option: stores into the option and says the new name."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:  # fmt: skip
        deprecated(str(option_string), flag(self.dest))
        setattr(namespace, self.dest, values)


def flag(field: str) -> str:
    """The command-line flag of a config field: ``batch_size`` -> ``--batch-size``."""
    return "--" + field.replace("_", "-")


@contextlib.contextmanager
def program_name(name: str) -> Iterator[None]:
    """Parsers built inside call themselves ``name`` in usage and help (``hybridrec
    train-dlrm``) instead of the script's file name."""
    token = _prog.set(name)
    try:
        yield
    finally:
        _prog.reset(token)


def program() -> str | None:
    """The name parsers call themselves (:func:`program_name`); None: the script's."""
    return _prog.get()


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


# ---------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`ConfigError` (one line) instead of printing the
    whole usage block and exiting."""

    def error(self, message: str) -> NoReturn:
        message = re.sub(r"^argument (\S+): ", r"\1: ", message)
        raise ConfigError(f"{message} ({self.prog} --help lists the options)")


def _add_field(p: Any, f: dataclasses.Field[Any], tp: Any) -> None:
    help_text = f.metadata.get("help", "")
    default = _default_of(f)
    help_text = f"{help_text} (default: {default!r})" if help_text else f"default: {default!r}"
    base, _ = _unwrap_optional(tp)  # None comes from the default or a JSON null
    kw: dict[str, Any] = {"dest": f.name, "help": help_text, "default": argparse.SUPPRESS}
    name = flag(f.name)
    for old in f.metadata.get("old_names", ()):
        old_kw = {**kw, "help": f"old name of {name}"}
        if base not in (int, float, str):
            raise TypeError(f"option {f.name!r}: old names need an int, float or str option")
        p.add_argument(flag(old), action=_OldName, type=base, **old_kw)
    if base is bool:
        p.add_argument(name, action=argparse.BooleanOptionalAction, **kw)
    elif get_origin(base) is Literal:
        choices = list(get_args(base))
        p.add_argument(name, choices=choices, type=type(choices[0]), **kw)
    elif get_origin(base) is list:
        (item,) = get_args(base)
        p.add_argument(name, nargs="+", type=item, **kw)
    elif base in (int, float, str):
        p.add_argument(name, type=base, metavar=base.__name__.upper(), **kw)
    else:
        raise TypeError(f"option {f.name!r}: unsupported type {tp!r} for the command line")


def _grouped(cls: type) -> list[tuple[str, list[dataclasses.Field[Any]]]]:
    """``cls``'s fields by its ``help_groups`` (in their order; the rest last, as "other")."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    groups: tuple[tuple[str, tuple[str, ...]], ...] = getattr(cls, "help_groups", ())
    out: list[tuple[str, list[dataclasses.Field[Any]]]] = []
    placed: set[str] = set()
    for title, names in groups:
        mine = [fields[n] for n in names if n in fields and n not in placed]
        if mine:
            out.append((title, mine))
            placed.update(f.name for f in mine)
    rest = [f for f in fields.values() if f.name not in placed]
    if rest:
        out.append(("other" if groups else "", rest))
    return out


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def options_markdown(cls: type, title: str) -> str:
    """The reference of ``cls``'s options as Markdown (a table per help group: flag,
    values, default, help), from the same fields the command line is built from."""
    hints = typing.get_type_hints(cls)
    lines = [f"## {title}", ""]
    for group, fields in _grouped(cls):
        if group:
            lines += [f"### {group} options", ""]
        lines += ["| option | values | default | what it does |", "| --- | --- | --- | --- |"]
        for f in fields:
            base, _ = _unwrap_optional(hints[f.name])
            if base is bool:
                name = f"`{flag(f.name)}` / `--no-{flag(f.name)[2:]}`"
            else:
                name = f"`{flag(f.name)}`"
            values = _expected(hints[f.name]).replace("|", "\\|")
            default = json.dumps(_default_of(f))
            text = str(f.metadata.get("help", "")).replace("|", "\\|")
            lines.append(f"| {name} | {values} | `{default}` | {text} |")
        lines.append("")
    return "\n".join(lines)


def build_parser(cls: type, description: str) -> argparse.ArgumentParser:
    p = _Parser(
        prog=_prog.get(),
        description=description,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog=f"{DEBUG_FLAG} (or HYBRIDREC_DEBUG=1): show the full traceback of an error "
        "instead of one line",
    )
    p.add_argument(
        "--config",
        default=None,
        help="a TOML or JSON file of option = value pairs; command-line options override it",
    )
    hints = typing.get_type_hints(cls)
    for title, fields in _grouped(cls):  # --help lists the options by group, in this order
        target: Any = p.add_argument_group(f"{title} options") if title else p
        for f in fields:
            _add_field(target, f, hints[f.name])
    return p


# ---------------------------------------------------------------- config files


class _Mismatch(Exception):
    """A file value does not fit the field's type: ``detail`` says what was expected."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def _shown(value: Any) -> str:
    """A file value as the user wrote it (JSON spelling: "512", true, [64, 32])."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # TOML dates and times
        return str(value)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a table"
    return f"a {type(value).__name__}"


def _expected(tp: Any) -> str:
    base, optional = _unwrap_optional(tp)
    if base is bool:
        text = "true or false"
    elif base is int:
        text = "an integer"
    elif base is float:
        text = "a number"
    elif base is str:
        text = "a string"
    elif get_origin(base) is Literal:
        text = "one of " + ", ".join(_shown(c) for c in get_args(base))
    elif get_origin(base) is list:
        (item,) = get_args(base)
        text = f"a list of {_items(item)} (e.g. [{_example(item)}])"
    else:
        text = repr(base)
    return f"{text} (or null)" if optional else text


def _items(tp: Any) -> str:
    plural = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}
    return plural.get(tp, f"items each {_expected(tp)}")


def _example(tp: Any) -> str:
    return {int: "64, 32", float: "0.5, 1.0", str: '"a", "b"'}.get(tp, "...")


def type_mismatch(value: Any, tp: Any) -> str | None:
    """None if a parsed TOML/JSON ``value`` fits type ``tp`` as a config file value must
    (an int is a number, a bool is not), else what was expected (``"an integer"``)."""
    try:
        _typed(value, tp)
    except _Mismatch:
        return _expected(tp)
    return None


def _typed(value: Any, tp: Any) -> Any:
    """``value`` checked against ``tp`` (and an int made a float where a float is
    expected, as the command line does); :class:`_Mismatch` if it does not fit."""
    base, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise _Mismatch(f"expected {_expected(tp)}, got null")
    fail = _Mismatch(f"expected {_expected(tp)}, got {_shown(value)} ({_kind(value)})")
    if base is bool:
        if not isinstance(value, bool):
            raise fail
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail
        return value
    if base is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise fail
        return float(value)
    if base is str:
        if not isinstance(value, str):
            raise fail
        return value
    if get_origin(base) is Literal:
        # 1 == True == 1.0 in Python, so the type must match as well as the value
        if not any(type(value) is type(c) and value == c for c in get_args(base)):
            raise fail
        return value
    if get_origin(base) is list:
        (item,) = get_args(base)
        if not isinstance(value, list):
            raise fail
        out = []
        for i, v in enumerate(value):
            try:
                out.append(_typed(v, item))
            except _Mismatch:
                raise _Mismatch(
                    f"expected {_expected(tp)}, got {_shown(value)}: item {i} is "
                    f"{_shown(v)} ({_kind(v)})"
                ) from None
        return out
    raise TypeError(f"unsupported option type {tp!r}")


def _read_file(p: Path) -> Any:
    try:
        if p.suffix == ".toml":
            with open(p, "rb") as fh:
                return tomllib.load(fh)
        if p.suffix == ".json":
            return json.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p}: not valid TOML: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"config file {p}: not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})"
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {p}: not UTF-8 text ({e.reason})") from None
    raise ConfigError(f"config file {p}: expected a .toml or .json file, got {p.suffix!r}")


def load_config_file(path: str | Path, cls: type) -> dict[str, Any]:
    """``path`` (TOML or JSON) -> ``{field: value}``, keys and value types checked
    against ``cls``; :class:`ConfigError` naming the key, its flag and the value."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {p} does not exist")
    raw = _read_file(p)
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {p}: expected a table of options, got {_kind(raw)}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    renamed = {o: f.name for f in dataclasses.fields(cls) for o in f.metadata.get("old_names", ())}
    out: dict[str, Any] = {}
    written: dict[str, str] = {}  # field -> the key as written in the file
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in renamed:
            deprecated(repr(key), repr(renamed[name]), where=f"config file {p}: ")
            name = renamed[name]
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0].replace('_', '-')!r}?)" if close else ""
            raise ConfigError(
                f"config file {p}: unknown option {key!r}{hint}; known options: {sorted(known)}"
            )
        if name in written:
            raise ConfigError(
                f"config file {p}: {written[name]!r} and {key!r} are the same option "
                f"({flag(name)}); give it once"
            )
        written[name] = key
        try:
            out[name] = _typed(value, hints[name])
        except _Mismatch as e:
            raise ConfigError(f"config file {p}: {key!r} ({flag(name)}): {e.detail}") from None
    return out


# ---------------------------------------------------------------- parse_config


def _fields_as_flags(message: str, fields: Sequence[str]) -> str:
    """Field names in ``message`` written as flags. A name inside a word, a flag or
    quotes (a value such as ``'data'``) is left alone."""
    names = sorted(fields, key=len, reverse=True)
    pattern = r"(?<![\w\-'\"])(" + "|".join(map(re.escape, names)) + r")(?![\w\-'\"])"
    return re.sub(pattern, lambda m: flag(m.group(1)), message)


def _debug_flag_taken(argv: list[str]) -> list[str]:
    """``argv`` without ``--debug``; seeing it turns tracebacks on (before anything
    else is parsed, so even a bad command line shows one)."""
    if DEBUG_FLAG not in argv:
        return argv
    show_tracebacks()
    return [a for a in argv if a != DEBUG_FLAG]


def parse_config(
    cls: type[T],
    argv: Sequence[str] | None,
    description: str,
    base: Mapping[str, Any] | None = None,
) -> T:
    """Defaults, then ``base`` (e.g. a saved run's options), then ``--config`` file values,
    then command-line values -> ``cls(...)``."""
    args_in = _debug_flag_taken(list(sys.argv[1:] if argv is None else argv))
    args = vars(build_parser(cls, description).parse_args(args_in))
    path = args.pop("config")
    values = dict(base or {})
    values.update(load_config_file(path, cls) if path else {})
    values.update(args)  # only options given on the command line (defaults are SUPPRESSed)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    for f in fields:
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in values:
            raise ConfigError(f"{flag(f.name)} is required (or {f.name!r} in a --config file)")
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:
        if e.args and isinstance(e.args[0], str):
            e.args = (_fields_as_flags(e.args[0], [f.name for f in fields]), *e.args[1:])
        raise


def config_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-able dict of a config dataclass, as metrics files and checkpoints record it:
    every password in a store URL replaced by ``***`` (:func:`ps.redact.redact_url`), so
    no secret reaches a file."""
    return {k: redact_values(v) for k, v in dataclasses.asdict(cfg).items()}
