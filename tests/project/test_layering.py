"""The import direction between the product packages, checked by parsing every file.

Lowest first: ``comm`` <- ``ps`` <- ``cache`` <- ``embedding``, and ``comm`` <- ``dense``;
the user-facing ``hybridrec`` package may import all five, and none of them imports it.
Nothing imports upward or sideways, and product code never imports ``tests`` or
``examples``/``benchmarks`` (test and job code). The checker is tested on synthetic sources
first, so it provably fires. Pickle imports are not checked here: test_security.py has the one
scan for pickle (and eval, torch.load, ...) over the product code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# package -> the product packages it may import (besides itself)
ALLOWED: dict[str, frozenset[str]] = {
    "comm": frozenset(),
    "ps": frozenset({"comm"}),
    "cache": frozenset({"comm", "ps"}),
    "embedding": frozenset({"comm", "ps", "cache"}),
    "dense": frozenset({"comm"}),
    "hybridrec": frozenset({"comm", "ps", "cache", "embedding", "dense"}),
}

# top-level modules product code must never import
FORBIDDEN: dict[str, str] = {
    "tests": "test code",
    "examples": "job code",
    "benchmarks": "benchmark code",
}

_DYNAMIC_IMPORTERS = {"import_module", "__import__"}


def _imports(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    """(line, absolute dotted name) for every import in ``tree``.

    ``module`` is the dotted name of the file (``ps.store.memory``; ``ps`` for
    ``ps/__init__.py``); relative imports are resolved against it. A relative import that
    climbs above the top-level package resolves to ``""``. Calls to ``importlib.import_module``
    or ``__import__`` with a literal name count too.
    """
    is_init = module.endswith(".__init__")
    parts = module.removesuffix(".__init__").split(".")
    package = parts if is_init else parts[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.append((node.lineno, node.module or ""))
            else:
                up = node.level - 1
                if up >= len(package):
                    found.append((node.lineno, ""))
                    continue
                base = ".".join(package[: len(package) - up])
                found.append((node.lineno, f"{base}.{node.module}" if node.module else base))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if (
                name in _DYNAMIC_IMPORTERS
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
            ):
                found.append((node.lineno, first.value))
    return found


def check_source(source: str, path: str, module: str) -> list[str]:
    """Violations in one file, each ``path:line: what``. ``module`` is its dotted name."""
    package = module.split(".")[0]
    if package not in ALLOWED:
        raise ValueError(f"{path}: package {package!r} is not one of {sorted(ALLOWED)}")
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as err:
        return [f"{path}:{err.lineno}: does not parse: {err.msg}"]
    bad: list[str] = []
    for line, name in _imports(tree, module):
        top = name.split(".")[0]
        if not top:
            bad.append(f"{path}:{line}: relative import climbs above package {package!r}")
        elif top in FORBIDDEN:
            bad.append(f"{path}:{line}: {package} imports {name!r}: {FORBIDDEN[top]}")
        elif top in ALLOWED and top != package and top not in ALLOWED[package]:
            allowed = ", ".join(sorted(ALLOWED[package])) or "no other product package"
            bad.append(f"{path}:{line}: {package} imports {top} (may import: {allowed})")
    return bad


def check_tree(root: Path) -> tuple[int, list[str]]:
    """(number of product files scanned, violations) for the packages under ``root``."""
    files = sorted(p for package in ALLOWED for p in (root / package).rglob("*.py"))
    bad: list[str] = []
    for path in files:
        rel = path.relative_to(root)
        module = ".".join(rel.with_suffix("").parts)
        bad.extend(check_source(path.read_text(encoding="utf-8"), str(rel), module))
    return len(files), bad


# --- the checker itself ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "source", "line", "expected"),
    [
        ("comm.group", "import ps\n", 1, "comm imports ps"),
        ("ps.store", "import os\nfrom embedding.batch import Ids\n", 2, "ps imports embedding"),
        ("cache.lru", "from dense import ddp\n", 1, "cache imports dense"),
        ("dense.zero", "import embedding.collection as ec\n", 1, "dense imports embedding"),
        ("dense.zero", "from ps import Store\n", 1, "dense imports ps"),
        ("embedding.batch", "import dense\n", 1, "embedding imports dense"),
        ("comm.codec", "def f():\n    import cache\n", 2, "comm imports cache"),
        ("comm.group", "from tests.multiproc import run\n", 1, "comm imports 'tests.multiproc'"),
        ("dense.gpt", "import hybridrec.dlrm.job\n", 1, "dense imports hybridrec"),
        ("ps.store", "from hybridrec.launch import roles\n", 1, "ps imports hybridrec"),
        ("embedding.hybrid", "import hybridrec\n", 1, "embedding imports hybridrec"),
        (
            "hybridrec.launch.roles",
            "import examples.train_dlrm\n",
            1,
            "hybridrec imports 'examples",
        ),
        (
            "hybridrec.train.loop",
            "from tests.multiproc import run\n",
            1,
            "imports 'tests.multiproc'",
        ),
        ("ps.__init__", "from .. import embedding\n", 1, "relative import climbs above package"),
        ("ps.store", "from ..embedding import x\n", 1, "relative import climbs above package"),
        ("comm.init", "import importlib\nimportlib.import_module('ps.x')\n", 2, "comm imports ps"),
        ("comm.init", "x = 1\n__import__('examples')\n", 2, "comm imports 'examples'"),
    ],
)
def test_checker_flags_bad_import(module: str, source: str, line: int, expected: str) -> None:
    bad = check_source(source, "synthetic.py", module)
    assert len(bad) == 1, bad
    assert bad[0].startswith(f"synthetic.py:{line}: "), bad[0]
    assert expected in bad[0], bad[0]


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("comm.group", "import torch\nimport numpy as np\nfrom comm.handle import Handle\n"),
        ("ps.memory", "from comm import ProcessGroup\nfrom . import clock\nfrom .clock import C\n"),
        ("ps.store.redis", "from .. import optimizers\nimport redis\n"),
        ("cache.__init__", "from cache.lru import LRU\nfrom ps import Store\nimport comm\n"),
        ("embedding.hybrid", "import cache\nimport ps\nimport comm\nfrom embedding import batch\n"),
        ("dense.ddp", "import comm\nimport torch.distributed as dist\n"),
        ("comm.init", "import importlib\nimportlib.import_module('mpi4py.MPI')\n"),
        ("hybridrec.dlrm.job", "import comm\nimport ps\nimport cache\nimport embedding\n"),
        (
            "hybridrec.train.loop",
            "from dense import DataParallel\nfrom hybridrec.launch import roles\n",
        ),
    ],
)
def test_checker_accepts_allowed_imports(module: str, source: str) -> None:
    assert check_source(source, "synthetic.py", module) == []


def test_checker_reports_file_and_line() -> None:
    source = "import torch\n\nfrom comm import init\nfrom cache import Cache\n"
    assert check_source(source, "ps/store.py", "ps.store") == [
        "ps/store.py:4: ps imports cache (may import: comm)"
    ]


def test_checker_reports_unparsable_file() -> None:
    bad = check_source("def f(:\n", "dense/broken.py", "dense.broken")
    assert len(bad) == 1 and bad[0].startswith("dense/broken.py:1: does not parse"), bad


# --- the real packages -----------------------------------------------------------------------


def test_checker_scans_every_file_of_a_tree(tmp_path: Path) -> None:
    (tmp_path / "dense" / "models").mkdir(parents=True)
    (tmp_path / "dense" / "__init__.py").write_text("import comm\n")
    (tmp_path / "dense" / "models" / "dlrm.py").write_text("import torch\n\nimport embedding\n")
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "job.py").write_text("import embedding, dense\n")  # not product code
    scanned, bad = check_tree(tmp_path)
    assert scanned == 2
    assert bad == [f"{Path('dense/models/dlrm.py')}:3: dense imports embedding (may import: comm)"]


def test_product_packages_respect_layering() -> None:
    scanned, bad = check_tree(ROOT)
    # A check that scans nothing proves nothing: comm always has code.
    assert scanned > 0 and any((ROOT / "comm").glob("*.py")), f"no product files under {ROOT}"
    assert not bad, (
        "imports against comm <- ps <- cache <- embedding, comm <- dense, all <- hybridrec:\n"
        + "\n".join(bad)
    )
