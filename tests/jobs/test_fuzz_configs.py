"""Random table configs and optimizer settings (hypothesis), valid and not.

* ``embedding.TableConfig`` from random fields (bad names, row counts, widths,
  feature lists, poolings, placements, optimizers, inits): an independent
  predicate says whether the fields are valid; valid ones build and ``to_spec()``
  carries them over; invalid ones raise ValueError/TypeError whose message names
  the table (when its name is valid) and shows the offending value.
* ``ps.TableSpec`` with random dynamic-table options and NaN policies, then a JSON
  round trip (``to_json``/``from_json`` gives an equal spec); a JSON with a field
  removed, renamed or of the wrong type is a ValueError/TypeError, never a spec.
* the optimizers with random (often bad) hyper-parameters: bad ones are a
  ValueError/TypeError naming the optimizer and the field.
* ``--config`` files of the DLRM and LM jobs with random keys (dashes or
  underscores) and values of every JSON kind: an independent table of what each
  option type accepts says whether the file is well typed; a badly typed one is a
  ``ConfigError`` naming the first bad key, its flag and the value; a well typed
  one gives the values (an int as a float where a float is expected) or fails the
  job's own checks with a message that names flags, not field names.

Counts: 300 + 200 + 200 + 2 x 200 examples (asserted; the config files split into
badly typed, failing the checks and valid ones, each asserted to occur).
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ps
from embedding import TableConfig
from hybridrec.cli.options import ConfigError, parse_config
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.lm.config import LMConfig

pytestmark = pytest.mark.timeout(120)

SETTINGS: dict[str, Any] = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow],
}

ANY_BAD: st.SearchStrategy[Any] = st.sampled_from([None, True, 1.5, "3", -1, 0, [], math.nan])
NAMES = st.one_of(st.sampled_from(["items", "u", "表"]), st.sampled_from(["", 3, None]))


@st.composite
def config_fields(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "name": draw(NAMES),
        "num_rows": draw(st.one_of(st.integers(1, 10**6), st.none(), ANY_BAD)),
        "dim": draw(st.one_of(st.integers(1, 512), ANY_BAD)),
        "feature_names": draw(
            st.one_of(
                st.lists(st.sampled_from(["f", "g", "h"]), min_size=1, max_size=3),
                st.sampled_from(["f", [], [""], [3], ("f", "g")]),
            )
        ),
        "pooling": draw(st.sampled_from(["sum", "mean", "none", "max", None])),
        "placement": draw(st.sampled_from(["local", "hybrid", "sharded", "remote"])),
        "optimizer": draw(st.sampled_from([ps.SGD(lr=0.1), ps.Adam(lr=0.01), "sgd", None])),
        "init": draw(st.sampled_from([None, ps.UniformInit(low=-1, high=1), (-1, 1)])),
    }


def _is_pos_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _config_problem(f: dict[str, Any]) -> str | None:
    """The field a valid TableConfig would reject first-or-any, or None if all are fine."""
    bad = []
    if not isinstance(f["name"], str) or not f["name"]:
        bad.append("name")
    if f["placement"] not in ("local", "hybrid", "sharded"):
        bad.append("placement")
    if f["num_rows"] is None:
        if f["placement"] != "hybrid":
            bad.append("num_rows")
    elif not _is_pos_int(f["num_rows"]):
        bad.append("num_rows")
    if not _is_pos_int(f["dim"]):
        bad.append("dim")
    feats = f["feature_names"]
    if (
        isinstance(feats, str)
        or not isinstance(feats, list | tuple)
        or not feats
        or not all(isinstance(x, str) and x for x in feats)
        or len(set(feats)) != len(feats)
    ):
        bad.append("feature_names")
    if f["pooling"] not in ("sum", "mean", "none"):
        bad.append("pooling")
    if not isinstance(f["optimizer"], ps.Optimizer):
        bad.append("optimizer")
    if f["init"] is not None and not isinstance(f["init"], ps.UniformInit):
        bad.append("init")
    return ",".join(bad) or None


def test_table_configs() -> None:
    count = [0, 0]

    @settings(max_examples=300, **SETTINGS)
    @given(config_fields())
    def run(f: dict[str, Any]) -> None:
        count[0] += 1
        problem = _config_problem(f)
        if problem is None:
            cfg = TableConfig(**f)
            spec = cfg.to_spec()
            assert (spec.name, spec.num_rows, spec.dim) == (f["name"], f["num_rows"], f["dim"])
            assert spec.optimizer == f["optimizer"] and cfg.feature_names == list(
                f["feature_names"]
            )
            return
        count[1] += 1
        with pytest.raises((ValueError, TypeError)) as info:
            TableConfig(**f)
        msg = str(info.value)
        if "name" not in problem.split(","):
            assert repr(f["name"]) in msg, (problem, msg)
        # The message shows one of the offending values (or names its type).
        shown = [repr(f[k]) for k in problem.split(",")] + [
            type(f[k]).__name__ for k in problem.split(",")
        ]
        shown += [repr(x) for x in f["feature_names"]] if "feature_names" in problem else []
        assert any(s in msg for s in shown), (problem, msg)

    run()
    assert count[0] >= 300 and count[1] >= 100, count


@st.composite
def spec_fields(draw: st.DrawFn) -> dict[str, Any]:
    dynamic = draw(st.booleans())
    return {
        "name": draw(st.sampled_from(["t", "big table"])),
        "num_rows": None if dynamic else draw(st.integers(1, 1000)),
        "dim": draw(st.integers(1, 64)),
        "optimizer": draw(
            st.sampled_from(
                [ps.SGD(lr=0.1, momentum=0.5), ps.RowWiseAdagrad(lr=0.1), ps.FTRL(alpha=0.1)]
            )
        ),
        "capacity": draw(st.one_of(st.none(), st.integers(-2, 100))),
        "max_age_steps": draw(st.one_of(st.none(), st.integers(-2, 100))),
        "nan_policy": draw(st.sampled_from(["raise", "skip", "ignore"])),
    }


def _spec_problems(f: dict[str, Any]) -> list[str]:
    bad = []
    for key in ("capacity", "max_age_steps"):
        v = f[key]
        if v is not None and (v <= 0 or f["num_rows"] is not None):
            bad.append(key)
    if f["nan_policy"] not in ("raise", "skip"):
        bad.append("nan_policy")
    return bad


def test_table_specs_and_their_json() -> None:
    count = [0]

    @settings(max_examples=200, **SETTINGS)
    @given(spec_fields(), st.sampled_from(["drop", "rename", "retype", "none"]))
    def run(f: dict[str, Any], mutation: str) -> None:
        count[0] += 1
        problems = _spec_problems(f)
        if problems:
            with pytest.raises(ValueError) as info:
                ps.TableSpec(**f)
            msg = str(info.value)
            assert repr(f["name"]) in msg and any(k in msg for k in problems), (problems, msg)
            return
        spec = ps.TableSpec(**f)
        data = spec.to_json()
        assert ps.TableSpec.from_json(data) == spec
        if mutation == "none":
            return
        if mutation == "drop":
            del data["dim"]
        elif mutation == "rename":
            data["dims"] = data.pop("dim")
        else:
            data["dim"] = "8"
        with pytest.raises((ValueError, TypeError), match="dim"):
            ps.TableSpec.from_json(data)

    run()
    assert count[0] >= 200, count


OPT_FIELDS: dict[type, dict[str, str]] = {
    ps.SGD: {"lr": "positive", "momentum": "unit"},
    ps.RowWiseAdagrad: {"lr": "positive", "eps": "positive", "initial_accumulator": "non-neg"},
    ps.Adagrad: {"lr": "positive", "eps": "positive", "initial_accumulator": "non-neg"},
    ps.Adam: {"lr": "positive", "eps": "positive", "weight_decay": "non-neg"},
    ps.FTRL: {"alpha": "positive", "beta": "non-neg", "l1": "non-neg", "l2": "non-neg"},
}
VALUES = st.sampled_from([0.1, 0.5, 0.0, -0.1, 1.0, 2.0, math.nan, math.inf, True, "0.1", None])


def _opt_ok(rule: str, v: object) -> bool:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return False
    if rule == "positive":
        return v > 0
    return v >= 0 if rule == "non-neg" else 0 <= v < 1


def test_optimizer_hyper_parameters() -> None:
    count = [0]

    @settings(max_examples=200, **SETTINGS)
    @given(st.sampled_from(sorted(OPT_FIELDS, key=lambda c: c.__name__)), st.data())
    def run(cls: type, data: st.DataObject) -> None:
        count[0] += 1
        rules = OPT_FIELDS[cls]
        kwargs = {k: data.draw(VALUES, label=k) for k in rules}
        bad = [k for k, rule in rules.items() if not _opt_ok(rule, kwargs[k])]
        if not bad:
            opt = cls(**kwargs)
            assert ps.optimizer_from_json(opt.to_json()) == opt
            return
        with pytest.raises((ValueError, TypeError)) as info:
            cls(**kwargs)
        msg = str(info.value)
        assert cls.__name__ in msg and any(k in msg for k in bad), (kwargs, msg)

    run()
    assert count[0] >= 200, count


FILE_VALUES: list[Any] = [
    0, 1, 7, -3, 512.0, 0.5, "512", "lru", "movielens", "hybrid", "byte", "adagrad", "fp16",
    True, False, None, [], [64, 32], [1.5], ["C1=sharded"], ["x", 1], {"a": 1},
]  # fmt: skip


def _file_accepts(tp: Any, v: Any) -> bool:
    """What a config file may hold for an option of type ``tp``: exactly the JSON kinds
    the command line would accept, with no conversion but int -> float."""
    if tp in (int, float, str, bool):
        return type(v) in {int: (int,), float: (int, float), str: (str,), bool: (bool,)}[tp]
    if typing.get_origin(tp) is Literal:
        return any(type(v) is type(c) and v == c for c in typing.get_args(tp))
    if tp == list[int] or tp == list[str]:
        (item,) = typing.get_args(tp)
        return type(v) is list and all(type(x) is item for x in v)
    args = typing.get_args(tp)
    if type(None) in args:  # X | None
        (inner,) = [a for a in args if a is not type(None)]
        return v is None or _file_accepts(inner, v)
    raise AssertionError(f"no rule for {tp!r}")


def _well_typed(tp: Any) -> list[Any]:
    """Values an option of type ``tp`` accepts, so that a good share of files is valid."""
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    table: dict[Any, list[Any]] = {
        int: [0, 1, 7, -3], float: [0, 0.5, 2.0, 3], str: ["fp16", "local", "x"],
        bool: [True, False], list[int]: [[], [64, 32]], list[str]: [[], ["C1=sharded"]],
    }  # fmt: skip
    if tp in table:
        return table[tp]
    (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
    return [None, *_well_typed(inner)]


@pytest.mark.parametrize("cls", [DLRMJobConfig, LMConfig])
def test_config_files(cls: type, tmp_path: Path) -> None:
    hints = typing.get_type_hints(cls)
    names = sorted(f.name for f in dataclasses.fields(cls))
    count = [0, 0, 0, 0]  # examples, badly typed, failing the job's checks, valid

    @settings(max_examples=200, **SETTINGS)
    @given(
        st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True),
        st.data(),
    )
    def run(chosen: list[str], data: st.DataObject) -> None:
        count[0] += 1
        items = [
            (
                name,
                data.draw(st.booleans(), label="dashes"),
                data.draw(
                    st.sampled_from(_well_typed(hints[name]))
                    if data.draw(st.booleans(), label="well typed")
                    else st.sampled_from(FILE_VALUES),
                    label=name,
                ),
            )
            for name in chosen
        ]
        doc = {(name.replace("_", "-") if dash else name): v for name, dash, v in items}
        path = tmp_path / "run.json"
        path.write_text(json.dumps(doc))
        bad = [(k, v) for k, v in doc.items() if not _file_accepts(hints[k.replace("-", "_")], v)]
        if bad:
            count[1] += 1
            with pytest.raises(ConfigError) as info:
                parse_config(cls, ["--config", str(path)], "t")
            key, value = bad[0]
            msg = str(info.value)
            flag = "--" + key.replace("_", "-")
            assert repr(key) in msg and f"({flag})" in msg and json.dumps(value) in msg, msg
            return
        try:
            cfg = parse_config(cls, ["--config", str(path)], "t")
        except ValueError as e:  # the job's own range checks
            count[2] += 1
            assert type(e) is not ConfigError, e
            fields_named = [n for n in names if "_" in n and n in str(e)]
            assert not fields_named, (str(e), fields_named)
            return
        for key, v in doc.items():
            name = key.replace("-", "_")
            resolved = ("epochs", "dim", "top_mlp", "interaction", "patience", "bottom_mlp")
            if name in resolved and v is None:
                continue  # resolved from --data / from --dim
            got = getattr(cfg, name)
            assert got == v and (hints[name] is not float or type(got) is float), (name, got)
        count[3] += 1

    run()
    assert count[0] >= 200 and count[1] >= 50 and count[2] >= 10 and count[3] >= 20, count
