"""Config dataclass -> command line, TOML/JSON run files, metrics plots."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from hybridrec.cli.options import ConfigError, build_parser, option, parse_config
from hybridrec.train.metrics_plot import metrics_figure, plot_metrics, read_metrics, run_title


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
    with pytest.raises(ConfigError, match=r"--data: invalid choice: 'c' \(choose from 'a', 'b'\)"):
        parse_config(_Cfg, ["--data", "c"], "t")
    with pytest.raises(ConfigError, match=r"'steps' \(--steps\): expected an integer, got 2.5"):
        toml.write_text("steps = 2.5\n")
        parse_config(_Cfg, ["--config", str(toml)], "t")
    with pytest.raises(ValueError, match="expected a .toml or .json file"):
        (tmp_path / "run.yaml").write_text("x")
        parse_config(_Cfg, ["--config", str(tmp_path / "run.yaml")], "t")


def test_help_explains_every_option() -> None:
    text = build_parser(_Cfg, "t").format_help()
    for flag, words in [("--steps", "steps to run"), ("--no-quiet", "print less"), ("--mlp", "")]:
        assert flag in text and words in text
    assert "--debug" in text  # the epilog: full tracebacks on request


def test_debug_is_taken_off_the_command_line() -> None:
    from hybridrec.cli.errors import show_tracebacks, tracebacks_shown

    try:
        assert parse_config(_Cfg, ["--steps", "3", "--debug"], "t") == _Cfg(steps=3)
        assert tracebacks_shown()
    finally:
        show_tracebacks(False)


def _rows_click() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = [
        {"kind": "step", "step": i, "loss": 1 / (i + 1)} for i in range(1, 21)
    ]
    rows += [{"kind": "eval", "step": 10, "val_auc": 0.6, "val_logloss": 0.66}]
    rows += [{"kind": "epoch", "steps": 20, "val_auc": 0.7, "val_logloss": 0.6}]
    rows += [{"kind": "step", "step": 20, "loss": 0.04}]  # a resume logged step 20 again
    rows += [{"kind": "final", "steps": 20, "test_auc": 0.72, "test_logloss": 0.58,
              "popularity_auc": 0.55, "popularity_logloss": 0.69}]  # fmt: skip
    return rows


def _lines(ax: object) -> dict[str, tuple[list[float], list[float]]]:
    return {
        line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
        for line in ax.get_lines()  # type: ignore[attr-defined]
    }


def test_click_plot_puts_log_loss_and_auc_on_separate_labelled_axes() -> None:
    import matplotlib.pyplot as plt

    fig = metrics_figure(_rows_click(), title="m.jsonl")
    ax_loss, ax_auc = fig.axes
    assert ax_loss.get_ylabel() == "log loss (nats per sample)"
    assert ax_auc.get_ylabel() == "ROC AUC (0.5 = chance, 1 = perfect)"
    assert ax_loss.get_xlabel() == ax_auc.get_xlabel() == "training step"
    loss, auc = _lines(ax_loss), _lines(ax_auc)
    want_train = [1 / (i + 1) for i in range(1, 20)] + [0.04]  # the later step-20 row wins
    # Bit for bit: the plot keeps the logged floats as they are.
    assert loss["training"] == (list(range(1, 21)), want_train)
    assert loss["validation"] == ([10, 20], [0.66, 0.6])
    assert loss["test"] == ([20], [0.58]) and auc["test"] == ([20], [0.72])
    assert auc["validation"] == ([10, 20], [0.6, 0.7])
    assert "training" not in auc  # AUC has no training curve; loss and AUC never share an axis
    assert auc["popularity baseline"][1] == [0.55, 0.55]  # a horizontal line
    assert loss["popularity baseline"][1] == [0.69, 0.69]
    plt.close(fig)


def test_the_test_result_sits_at_the_tested_model_and_the_title_names_the_run() -> None:
    """The job tests the restored best epoch's model: the star goes to that epoch's step,
    not the last one; the title says the job and the data, then the file."""
    import matplotlib.pyplot as plt

    rows = _rows_click()
    rows[-1] = {**rows[-1], "tested_step": 10, "config": {"data": "movielens"}}
    fig = metrics_figure(rows)
    ax_loss, ax_auc = fig.axes
    assert _lines(ax_loss)["test"] == ([10], [0.58]) and _lines(ax_auc)["test"] == ([10], [0.72])
    plt.close(fig)
    assert run_title(rows, "m.jsonl") == "DLRM on movielens data (m.jsonl)"
    lm = [{"kind": "eval", "step": 0, "val_loss": 5.0}]
    lm += [{"kind": "final", "steps": 1, "config": {"tokenizer": "byte"}}]
    assert run_title(lm, "lm.jsonl") == "GPT language model, byte tokens (lm.jsonl)"
    assert run_title([{"kind": "step", "step": 1, "loss": 1.0}], "x.jsonl") == "x.jsonl"


def test_lm_plot_shows_loss_and_perplexity() -> None:
    import matplotlib.pyplot as plt

    rows = [{"kind": "step", "step": s, "loss": 5.0 - s / 10} for s in (5, 10, 15)]
    rows += [{"kind": "eval", "step": s, "val_loss": 5.0 - s / 10} for s in (0, 15)]
    fig = metrics_figure(rows)
    ax_loss, ax_ppl = fig.axes
    assert ax_loss.get_ylabel() == "cross-entropy (nats per token)"
    assert ax_ppl.get_ylabel() == "perplexity (exp of nats per token)"
    assert ax_ppl.get_yscale() == "log"
    xs, ys = _lines(ax_ppl)["validation"]
    # Bit for bit: the plot takes math.exp of the same exact losses (5.0 and 3.5).
    assert xs == [0, 15] and ys == [math.exp(5.0), math.exp(3.5)]
    plt.close(fig)
    fig = metrics_figure(rows[:3])  # no validation: the training loss alone
    assert [ax.get_ylabel() for ax in fig.axes] == ["training loss"]
    plt.close(fig)


def test_ranking_plot_shows_loss_and_hr_ndcg_with_test_and_popularity() -> None:
    """A next-item run: the training loss left, validation HR@10 and NDCG@10 right, the
    test results as stars at the tested step and each popularity baseline once."""
    import matplotlib.pyplot as plt

    rows: list[dict[str, object]] = [{"kind": "step", "step": s, "loss": 7.0 - s / 10}
                                     for s in (4, 8)]  # fmt: skip
    rows += [{"kind": "epoch", "step": s, "val_hr@10": h, "val_ndcg@10": n}
             for s, h, n in ((4, 0.1, 0.05), (8, 0.2, 0.09))]  # fmt: skip
    rows += [{"kind": "final", "steps": 8, "tested_step": 8, "test_hr@10": 0.21,
              "test_ndcg@10": 0.1, "popularity_hr@10": 0.05, "popularity_ndcg@10": 0.02,
              "config": {"model": "hstu", "data": "movielens"}}]  # fmt: skip
    fig = metrics_figure(rows)
    ax_loss, ax_rank = fig.axes
    assert ax_loss.get_ylabel() == "cross-entropy (nats per predicted item)"
    lines = [(ln.get_label(), list(ln.get_xdata()), list(ln.get_ydata()))
             for ln in ax_rank.get_lines()]  # fmt: skip
    assert ("validation HR@10", [4, 8], [0.1, 0.2]) in lines
    assert ("validation NDCG@10", [4, 8], [0.05, 0.09]) in lines
    assert [y for label, _, y in lines if label == "test"] == [[0.21], [0.1]]
    assert [y[0] for label, _, y in lines if label == "popularity baseline"] == [0.05, 0.02]
    legend = [t.get_text() for t in ax_rank.get_legend().get_texts()]
    assert legend.count("test") == 1 and legend.count("popularity baseline") == 1
    plt.close(fig)
    assert run_title(rows, "s.jsonl") == "HSTU on movielens data (s.jsonl)"


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    rows = [{"kind": "step", "step": i, "loss": 1 / (i + 1)} for i in range(20)]
    rows += [{"kind": "epoch", "steps": 20, "val_auc": 0.7, "val_logloss": 0.6}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(read_metrics(path)) == 21
    png = plot_metrics(path)
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
