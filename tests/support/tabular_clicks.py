"""A small tabular click data set for the after-training tests: a label, one dense and
two vocabulary columns, clicks that depend on the user and the item (so a model learns);
and the scores file predict writes, read back."""

from __future__ import annotations

import csv
import random
import zlib
from pathlib import Path


def write_clicks(path: Path, rows: int, seed: int, users: list[str]) -> None:
    """``rows`` lines of ``label,age,user,item`` (users drawn from ``users``)."""
    rng = random.Random(seed)
    lines = ["label,age,user,item"]
    for _ in range(rows):
        user = rng.choice(users)
        item = f"i{int(rng.paretovariate(1.2)) % 50}"
        age = rng.uniform(18, 70)
        clicks = (zlib.crc32(user.encode()) + zlib.crc32(item.encode())) % 3 == 0
        click = int(clicks) if rng.random() < 0.8 else rng.randint(0, 1)
        lines.append(f"{click},{age:.1f},{user},{item}")
    path.write_text("\n".join(lines) + "\n")


CLICKS_SCHEMA = {
    "label": {"column": "label"},
    "dense": [{"column": "age", "standardize": True}],
    "sparse": [{"column": "user", "vocab": True}, {"column": "item", "vocab": True}],
}


def read_scores(path: Path) -> list[dict[str, str]]:
    """The rows of a CSV that ``hybridrec predict`` wrote, as ``{column: text}``."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
