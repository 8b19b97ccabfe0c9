"""The DLRM data path goes one way: following each data config's calls from
``hybridrec/dlrm/data.py:open_source`` (open the source, one training batch, the
validation batches), every call from one file into another goes down the levels below,
so each file is read once on the way down (no callbacks up, no reader calling another).

Checked twice: the calls themselves (traced with ``sys.setprofile``) and the imports.
"""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import comm
from criteo_fixture import write_criteo_fixture
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.data import open_source
from multiproc import ROOT

DATASETS = ROOT / "hybridrec" / "datasets"
# The way down: job data config -> readers parse -> the schema they follow -> streamed
# records -> encoders -> batches. Files on one level never call each other.
LEVELS: dict[str, int] = {
    "dlrm/data.py": 0,
    "datasets/movielens.py": 1,  # MovieLens-100k: the RecBole reader with a schema
    "datasets/recbole.py": 2,
    "datasets/tabular.py": 2,
    "datasets/criteo.py": 2,
    "datasets/synthetic.py": 2,
    "datasets/schema.py": 3,
    "datasets/stream.py": 4,
    "datasets/encode.py": 5,
    "datasets/ctr.py": 6,
}
TRACKED = {
    str(ROOT / "hybridrec" / "dlrm" / "data.py"): "dlrm/data.py",
    **{str(DATASETS / name.split("/")[1]): name for name in LEVELS if name.startswith("datasets/")},
}


def _calls(run: Callable[[], Any]) -> list[tuple[str, str]]:
    """The (caller file, callee file) pairs of ``run``'s calls between tracked files, in
    order of first occurrence (a resumed generator counts as called by its consumer)."""
    edges: list[tuple[str, str]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = TRACKED.get(frame.f_code.co_filename)
        if callee is None:
            return
        up = frame.f_back  # the nearest tracked caller, past library frames
        while up is not None and up.f_code.co_filename not in TRACKED:
            up = up.f_back
        if up is None:
            return
        caller = TRACKED[up.f_code.co_filename]
        if caller != callee and (caller, callee) not in edges:
            edges.append((caller, callee))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return edges


def _walk(cfg: DLRMJobConfig) -> list[tuple[str, str]]:
    def run() -> None:
        source = open_source(cfg, comm.LocalGroup())
        next(iter(source.train_batches(0)))
        list(source.eval_batches("val"))

    return _calls(run)


def _configs(tmp: Path) -> dict[str, tuple[DLRMJobConfig, list[str]]]:
    """Each data kind's config and the files its walk must visit, top down."""
    base: dict[str, Any] = dict(batch_size=4, eval_batch_size=8, verbose=False, progress=False)
    rows = [
        ["1" if i % 3 else "0", *[str(i + k) for k in range(13)],
         *[f"{(i * 7 + k) % 5:08x}" for k in range(26)]]
        for i in range(12)
    ]  # fmt: skip
    write_criteo_fixture(tmp / "day.tsv", rows)
    lines = ["y,price,user,tags"] + [f"{i % 2},{i * 1.5},u{i % 3},a|b{i % 2}" for i in range(12)]
    (tmp / "d.csv").write_text("\n".join(lines) + "\n")
    (tmp / "s.json").write_text(json.dumps({
        "label": {"column": "y"},
        "dense": [{"column": "price", "log": True, "standardize": True}],
        "sparse": [{"column": "user", "vocab": True},
                   {"column": "tags", "separator": "|", "hash_rows": 9}],
    }))  # fmt: skip
    shop = tmp / "shop"
    shop.mkdir()
    inter = ["uid:token\tiid:token\trating:float\tctx:token_seq"] + [
        f"u{i % 4}\tx{i % 3}\t{i % 5 + 1}\tt{i % 2} t3" for i in range(20)
    ]
    (shop / "shop.inter").write_text("\n".join(inter) + "\n")
    down = ["dlrm/data.py"]
    return {
        "criteo": (
            DLRMJobConfig(**base, data="criteo", criteo_path=[str(tmp / "day.tsv")],
                          criteo_val_path=[str(tmp / "day.tsv")], criteo_rows=50),
            [*down, "datasets/criteo.py", "datasets/stream.py", "datasets/encode.py"],
        ),
        "tabular": (
            DLRMJobConfig(**base, data="tabular", data_path=[str(tmp / "d.csv")],
                          data_val_path=[str(tmp / "d.csv")], schema=str(tmp / "s.json")),
            [*down, "datasets/tabular.py", "datasets/schema.py", "datasets/stream.py",
             "datasets/encode.py"],
        ),
        "recbole": (
            DLRMJobConfig(**base, data="recbole", data_path=[str(shop)]),
            [*down, "datasets/recbole.py", "datasets/schema.py", "datasets/encode.py",
             "datasets/ctr.py"],
        ),
        "movielens": (
            DLRMJobConfig(**base, data="movielens"),
            [*down, "datasets/movielens.py", "datasets/recbole.py", "datasets/schema.py",
             "datasets/encode.py", "datasets/ctr.py"],
        ),
        "synthetic": (
            DLRMJobConfig(**base, data="synthetic", synthetic_samples=200, synthetic_rows=20),
            [*down, "datasets/synthetic.py", "datasets/encode.py", "datasets/ctr.py"],
        ),
    }  # fmt: skip


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["criteo", "tabular", "recbole", "movielens", "synthetic"])
def test_each_data_config_walks_down_once(tmp_path: Path, kind: str) -> None:
    cfg, files = _configs(tmp_path)[kind]
    edges = _walk(cfg)
    upward = [(a, b) for a, b in edges if LEVELS[a] >= LEVELS[b]]
    assert not upward, f"{kind}: calls that go up or sideways: {upward} (all: {edges})"
    visited = sorted({f for e in edges for f in e}, key=lambda f: LEVELS[f])
    # Batches (ctr.py) are dataclasses without code of their own on the streamed path,
    # so a trace sees them only where a data set is built in memory.
    assert visited == files, f"{kind}: visited {visited}"


def _imports(path: Path) -> set[str]:
    """The hybridrec.datasets modules ``path`` imports (file names)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            mod = node.module
            if mod == "hybridrec.datasets":
                out |= {f"{a.name}.py" for a in node.names}
            elif mod.startswith("hybridrec.datasets."):
                out.add(mod.rsplit(".", 1)[1] + ".py")
        elif isinstance(node, ast.Import):
            out |= {a.name.rsplit(".", 1)[1] + ".py" for a in node.names
                    if a.name.startswith("hybridrec.datasets.")}  # fmt: skip
    return out


def test_imports_go_down_the_levels_too() -> None:
    wrong = []
    for name, level in LEVELS.items():
        path = ROOT / "hybridrec" / name
        for imp in sorted(_imports(path)):
            target = f"datasets/{imp}"
            if target not in LEVELS or LEVELS[target] <= level:
                wrong.append(f"{name} imports {target}")
    # The language-model example's files stand apart: text.py uses bpe.py only.
    assert _imports(DATASETS / "text.py") <= {"bpe.py"} and not _imports(DATASETS / "bpe.py")
    # The next-item job's histories sit beside dlrm/data.py: sequences.py reads with the
    # readers below it (never the other way), its synthetic histories build on it alone.
    for imp in sorted(_imports(DATASETS / "sequences.py")):
        if LEVELS.get(f"datasets/{imp}", 0) < 1:
            wrong.append(f"datasets/sequences.py imports datasets/{imp}")
    assert _imports(DATASETS / "synthetic_sequences.py") == {"sequences.py"}
    assert not any("sequences" in i for f in LEVELS for i in _imports(ROOT / "hybridrec" / f))
    assert not wrong, wrong
    listed = {f"datasets/{p.name}" for p in DATASETS.glob("*.py")}
    assert listed - set(LEVELS) == {
        "datasets/__init__.py", "datasets/text.py", "datasets/bpe.py",
        "datasets/sequences.py", "datasets/synthetic_sequences.py",
    }  # fmt: skip
