"""The C kernels follow one convention and ship with the wheel.

Every C source is ``<package>/kernels/<name>.c`` next to its loader ``<name>.py``, which
reads it through ``comm.native.kernel_source`` (importlib.resources: a checkout, an
editable install and an installed wheel alike), and pyproject.toml ships every such
folder's ``*.c`` as package data (checked here against the file tree, so a new kernel
folder cannot be forgotten; a wheel built from it was checked to load all three).
"""

from __future__ import annotations

import importlib
import tomllib

import pytest

from comm.native import kernel_source
from multiproc import ROOT

pytestmark = pytest.mark.timeout(30)

SOURCES = sorted(p.relative_to(ROOT) for p in ROOT.glob("*/kernels/*.c"))


def test_every_c_source_follows_the_convention_and_is_package_data() -> None:
    assert {str(p) for p in SOURCES} == {
        "cache/kernels/admit.c",
        "cache/kernels/pack_ids.c",
        "cache/kernels/plan_pull.c",
        "cache/kernels/records.c",
        "cache/kernels/sketch.c",
        "cache/kernels/sorted_ids.c",
        "cache/kernels/victim_pool.c",
        "dense/kernels/interaction.c",
        "ps/kernels/message_pass.c",
        "ps/kernels/narrow_rows.c",
        "ps/kernels/rowwise_adagrad.c",
    }
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = data["package-data"]
    for path in SOURCES:
        package = ".".join(path.parent.parts)
        assert "*.c" in shipped.get(package, []), f"{path} is not package data"
        loader = importlib.import_module(f"{package}.{path.stem}")  # <name>.py beside it
        assert loader._SOURCE == kernel_source(package, path.stem) == (ROOT / path).read_text()
    assert not list(ROOT.glob("*/*.c")), "C sources belong in a kernels/ subpackage"
