"""Scores of a saved DLRM for every row of tabular, Criteo or RecBole files (``hybridrec predict``).

Every rank reads its share of the files (record ``i`` of a file goes to rank ``i mod
n``, as in training), encodes it with the saved run's encoders, scores it, and sends
``(file, line, key columns, score)`` to rank 0, which writes one line per scored row in
file and line order: every row that parses is scored exactly once, whatever the rank
count. Tabular files need no label column (it is ignored when present); Criteo lines
are the training format (the label field is read and ignored); a RecBole-format run
(``--data recbole`` or ``movielens``) scores one folder of atomic files, each
interaction joined with its user's and item's fields, and needs no rating either. A
row that does not parse stops the run naming ``file:line``, or with ``--skip-bad-lines``
is left out.

Output by the name's suffix: ``.csv`` (a header, then the key columns and ``score``),
``.jsonl`` (one object per row) or ``.parquet`` (needs pyarrow). Without ``--key`` the
rows are named by ``file`` and ``line``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from comm import ProcessGroup
from hybridrec.datasets.criteo import CriteoConfig, CriteoReader
from hybridrec.datasets.ctr import Batch, KeyRow
from hybridrec.datasets.recbole import keyed_batches
from hybridrec.datasets.stream import PARQUET_HINT
from hybridrec.datasets.tabular import TabularConfig, TabularReader
from hybridrec.dlrm.data import CriteoSource, InMemorySource, recbole_schema
from hybridrec.dlrm.model import DLRM
from hybridrec.train.device_batches import DeviceBatches
from hybridrec.train.precision import autocast

FORMATS = (".csv", ".jsonl", ".parquet")


def output_format(path: str | Path) -> str:
    """The suffix of ``path`` that says how scores are written; ValueError otherwise, and
    for Parquet without pyarrow (a user error, said before anything is scored)."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"--out {path}: name a {', '.join(FORMATS)} file")
    if suffix == ".parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            hint = f"--out {path}: writing Parquet needs pyarrow ({PARQUET_HINT})"
            raise ValueError(hint) from None
    return suffix


def scored_rows(
    source: Any, paths: Sequence[str], keys: Sequence[str], group: ProcessGroup
) -> tuple[list[str], Iterator[tuple[Batch, list[KeyRow]]]]:
    """The files that name the rows, and this rank's rows of ``paths`` as batches with
    where they are and their ``keys`` columns, encoded as the saved run encoded its own
    (``source``: the job's source, built from the run's encoders). A label is not read:
    the files to score need none. A RecBole-format run (RecBole, MovieLens) scores one
    folder of atomic files, its rows named by the ``.inter`` file's lines."""
    cfg = source.cfg
    if isinstance(source, InMemorySource):
        if source.encoders is None:
            raise ValueError(
                f"--data {cfg.data}: a generated data set has no files to score; "
                "hybridrec evaluate scores its held-out split"
            )
        if len(paths) != 1:
            raise ValueError(
                f"--input {' '.join(paths)}: a --data {cfg.data} run scores one folder of "
                "RecBole atomic files (NAME.inter, and NAME.user / NAME.item if any)"
            )
        inter, rows = keyed_batches(
            paths[0], recbole_schema(cfg), source.encoders, keys,
            batch_size=cfg.eval_batch_size, rank=group.rank, world_size=group.size,
            skip_bad_lines=cfg.skip_bad_lines,
        )  # fmt: skip
        return [str(inter)], rows
    if isinstance(source, CriteoSource):
        if keys:
            raise ValueError(
                f"--key {' '.join(keys)}: Criteo lines have no named columns; their rows "
                "are named by file and line"
            )
        config = CriteoConfig(
            paths=list(paths), batch_size=cfg.eval_batch_size, num_rows=cfg.criteo_rows or None,
            rank=group.rank, world_size=group.size, skip_bad_lines=cfg.skip_bad_lines,
        )  # fmt: skip
        return list(paths), CriteoReader(config).keyed()
    schema = dataclasses.replace(source.schema, label=None)
    encoders = dataclasses.replace(source.fitted.encoders, label=None)
    reader = TabularReader(
        TabularConfig(
            paths=list(paths), schema=schema, encoders=encoders, batch_size=cfg.eval_batch_size,
            rank=group.rank, world_size=group.size, skip_bad_lines=cfg.skip_bad_lines,
        )
    )  # fmt: skip
    return list(paths), reader.keyed(keys)


@torch.no_grad()
def score(
    model: DLRM,
    rows: Iterator[tuple[Batch, list[KeyRow]]],
    feed: DeviceBatches,
    precision: str,
) -> tuple[list[KeyRow], torch.Tensor]:
    """This rank's keys and probabilities ``[n]`` (float32, on the host). ``feed`` copies
    each batch to the device while the one before is scored (its keys ride along); the
    scores stay on the device until the end."""
    model.eval()
    keys: list[KeyRow] = []
    probs = [torch.empty(0, device=feed.device)]
    for on_device, batch_keys in feed.batches(rows, pairs=True):
        with autocast(feed.device, precision):
            logits = model(on_device)
        probs.append(torch.sigmoid(logits.float()))
        keys.extend(batch_keys)
    model.train()
    return keys, torch.cat(probs).cpu()


def _gathered(group: ProcessGroup, rows: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``rows`` (``[n_rank, *tail]``, any ``n_rank`` including 0), on every
    rank, one tensor per rank: each sends one padding row more, so no rank sends none."""
    counts = group.allgatherv(torch.tensor([rows.shape[0]], dtype=torch.int64)).tolist()
    pad = torch.zeros((1, *rows.shape[1:]), dtype=rows.dtype)
    joined = group.allgatherv(torch.cat([pad, rows]).contiguous())
    out, at = [], 0
    for n in counts:
        out.append(joined[at + 1 : at + 1 + n])
        at += n + 1
    return out


def gather_scores(
    keys: list[KeyRow], probs: torch.Tensor, group: ProcessGroup, key_count: int
) -> list[tuple[int, int, list[str], float]] | None:
    """Every rank's scored rows on rank 0, in file and line order (collective); None on
    the other ranks. Key texts travel as utf-8 bytes with their lengths (no pickle)."""
    where = torch.tensor([[f, line] for f, line, _ in keys], dtype=torch.int64).reshape(-1, 2)
    blobs = [t.encode("utf-8") for _, _, cols in keys for t in cols]
    data = torch.tensor(list(b"".join(blobs)), dtype=torch.uint8)
    lengths = torch.tensor([len(b) for b in blobs], dtype=torch.int64)
    parts = zip(
        _gathered(group, where), _gathered(group, probs), _gathered(group, lengths),
        _gathered(group, data), strict=True,
    )  # fmt: skip
    if group.rank != 0:
        return None
    out = []
    for rank_where, rank_probs, rank_lengths, rank_data in parts:
        blob, at, cols = bytes(rank_data.tolist()), 0, []
        for n in rank_lengths.tolist():
            cols.append(blob[at : at + n].decode("utf-8"))
            at += n
        for i, ((f, line), p) in enumerate(
            zip(rank_where.tolist(), rank_probs.tolist(), strict=True)
        ):
            out.append((int(f), int(line), cols[i * key_count : (i + 1) * key_count], float(p)))
    out.sort(key=lambda r: (r[0], r[1]))
    return out


def write_scores(
    path: str | Path,
    rows: list[tuple[int, int, list[str], float]],
    keys: Sequence[str],
    files: Sequence[str],
) -> None:
    """``rows`` (``(file index, line, key texts, score)``) to ``path`` in its format."""
    fmt = output_format(path)
    names = list(keys) if keys else ["file", "line"]

    def named(r: tuple[int, int, list[str], float]) -> list[Any]:
        return [*r[2]] if keys else [files[r[0]], r[1]]

    if fmt == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow([*names, "score"])
            for r in rows:
                w.writerow([*named(r), repr(r[3])])
    elif fmt == ".jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps({**dict(zip(names, named(r), strict=True)), "score": r[3]}))
                f.write("\n")
    else:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(
                f"--out {path}: writing Parquet needs pyarrow ({PARQUET_HINT})"
            ) from None
        columns = {n: [named(r)[i] for r in rows] for i, n in enumerate(names)}
        columns["score"] = [r[3] for r in rows]
        pq.write_table(pa.table(columns), str(path))
