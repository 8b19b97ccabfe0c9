"""Config dataclass -> command line, TOML/JSON run files, metrics plots."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from hybridrec.config import build_parser, option, parse_config
from hybridrec.plot import plot_metrics, read_metrics


@dataclass(kw_only=True, slots=True)
class _Cfg:
    data: Literal["a", "b"] = option("a", help="which data")
    steps: int = option(10, help="steps to run")
    lr: float = option(0.5, help="learning rate")
    mlp: list[int] = option([4, 2], help="layer widths")
    out: str | None = option(None, help="where to write")
    quiet: bool = option(False, help="print less")


def test_defaults_file_and_command_line_in_that_order(tmp_path: Path) -> None:
    assert parse_config(_Cfg, [], "t") == _Cfg()
    toml = tmp_path / "run.toml"
    toml.write_text('data = "b"\nsteps = 7\nmlp = [8, 8, 1]\n')
    cfg = parse_config(_Cfg, ["--config", str(toml), "--steps", "3", "--quiet"], "t")
    assert cfg == _Cfg(data="b", steps=3, mlp=[8, 8, 1], quiet=True)
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"lr": 0.1, "out": "m.jsonl"}))
    assert parse_config(_Cfg, ["--config", str(js)], "t") == _Cfg(lr=0.1, out="m.jsonl")


def test_unknown_key_and_bad_values_are_named(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("stepz = 3\n")
    with pytest.raises(ValueError, match="unknown option 'stepz'"):
        parse_config(_Cfg, ["--config", str(toml)], "t")
    with pytest.raises(SystemExit):
        parse_config(_Cfg, ["--data", "c"], "t")
    with pytest.raises(ValueError, match="expected a .toml or .json file"):
        (tmp_path / "run.yaml").write_text("x")
        parse_config(_Cfg, ["--config", str(tmp_path / "run.yaml")], "t")


def test_help_explains_every_option() -> None:
    text = build_parser(_Cfg, "t").format_help()
    for flag, words in [("--steps", "steps to run"), ("--no-quiet", "print less"), ("--mlp", "")]:
        assert flag in text and words in text


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    rows = [{"kind": "step", "step": i, "loss": 1 / (i + 1)} for i in range(20)]
    rows += [{"kind": "epoch", "steps": 20, "val_auc": 0.7, "val_logloss": 0.6}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(read_metrics(path)) == 21
    png = plot_metrics(path)
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
