"""Write a trained DLRM as a self-contained export (:mod:`hybridrec.serving.artefact`).

Layout of ``MODEL_DIR``::

    manifest.json        format, versions, the model (dense config, features, tables),
                         every file's size and sha256
    tables/tNNN.rows.npy        table NNN's rows: float32 / float16 / uint8 codes [n, D]
    tables/tNNN.scale_bias.npy  int8 only: float32 [n, 2] (scale, bias) per row
    tables/tNNN.ids.npy         dynamic tables only: the sorted int64 ids [n] of the rows
    dense/NNN.npy               the dense part's state dict, one array per entry
    job_config.json      the run's options (its checkpoint meta's config)
    encoders.json        the fitted data encoders, when the run had them
    dense_program.pt2    torch.export of the dense part, for other consumers, when
                         torch.export can express it (the predictor never reads it: it
                         holds pickled data)

The predictor rebuilds the dense part from its config (``dense.DLRMConfig``) and the
``.npy`` weights, so loading an export runs no unpickling.
"""

from __future__ import annotations

import dataclasses
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dense import DataParallel, DLRMDense
from embedding import EmbeddingCollection, TableConfig
from hybridrec.serving.artefact import ExportWriter
from hybridrec.serving.quantize import TableDtype, encode_rows, row_bytes


def hybridrec_version() -> str:
    try:
        return metadata.version("hybridrec")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def full_tables(ec: EmbeddingCollection) -> list[tuple[TableConfig, np.ndarray | None, np.ndarray]]:
    """Every table of ``ec`` whole, in the collection's order: ``(config, ids, rows)`` with
    float32 ``rows [n, D]``; ``ids`` int64 ``[n]`` sorted for a dynamic table (the rows it
    holds), None for a fixed one (row ``i`` is id ``i``). One process holds every table
    (local, hybrid in its store, or all shards of a sharded one)."""
    hybrid = {}
    if ec.hybrid is not None:
        hybrid = {spec.name: part for spec, part in ec.hybrid.table_parts()}
    sharded = {} if ec.sharded is None else ec.sharded.state_dict()
    out: list[tuple[TableConfig, np.ndarray | None, np.ndarray]] = []
    for cfg in ec.tables:
        if cfg.placement == "local":
            assert ec.local is not None and cfg.num_rows is not None
            rows = ec.local.rows(cfg.name, torch.arange(cfg.num_rows)).cpu()
            out.append((cfg, None, rows.numpy()))
            continue
        if cfg.placement == "hybrid":
            ids, weights = hybrid[cfg.name].ids, hybrid[cfg.name].weights
        else:
            ids, weights = sharded[f"{cfg.name}.ids"].cpu(), sharded[f"{cfg.name}.weight"].cpu()
        order = torch.argsort(ids)
        ids, weights = ids[order], weights[order].to(torch.float32)  # [n], [n, D]
        if cfg.num_rows is None:
            out.append((cfg, ids.numpy(), weights.numpy()))
            continue
        # A fixed table read by id: row i at position i; rows never written keep their
        # initial values (as a pull reads them).
        rows = cfg.to_spec().initial_rows(torch.arange(cfg.num_rows))  # [n, D]
        rows[ids] = weights
        out.append((cfg, None, rows.numpy()))
    return out


def dense_module(model: nn.Module) -> DLRMDense:
    """The model's :class:`dense.DLRMDense`, unwrapped from ``DataParallel``."""
    dense = model.dense  # type: ignore[union-attr]
    if isinstance(dense, DataParallel):
        dense = dense.module
    if not isinstance(dense, DLRMDense):
        raise TypeError(f"export: the dense part is a {type(dense).__name__}, not a DLRMDense")
    return dense


def export_dlrm(
    model: nn.Module,
    out: str | Path,
    *,
    tables: TableDtype = "fp32",
    job_config: dict[str, Any] | None = None,
    encoders: dict[str, Any] | None = None,
    source: dict[str, Any] | None = None,
    dense_program: bool = True,
) -> dict[str, Any]:
    """Write ``model`` (a :class:`hybridrec.dlrm.model.DLRM` in one process) into the new
    folder ``out``; returns the manifest. ``tables``: the row format of every table
    (:mod:`hybridrec.serving.quantize`); ``job_config`` / ``encoders``: the run's options
    and fitted encoders (JSON data); ``source``: where the model came from (checkpoint,
    step), for the manifest; ``dense_program``: also try ``torch.export`` of the dense part."""
    folder = Path(out)
    if folder.exists() and any(folder.iterdir()):
        raise FileExistsError(f"--out {folder}: exists and is not empty; give a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    writer = ExportWriter(folder)
    ec: EmbeddingCollection = model.embeddings  # type: ignore[assignment]
    table_docs: dict[str, Any] = {}
    features: list[dict[str, Any]] = []
    for i, (cfg, ids, rows) in enumerate(full_tables(ec)):
        doc: dict[str, Any] = {
            "dim": cfg.dim,
            "num_rows": cfg.num_rows,
            "dtype": tables,
            "stored_rows": int(rows.shape[0]),
            "bytes_per_row": row_bytes(tables, cfg.dim),
        }
        for what, arr in encode_rows(rows, tables).items():
            doc[what] = writer.array(f"tables/t{i:03d}.{what}.npy", arr)
        if ids is not None:
            doc["ids"] = writer.array(f"tables/t{i:03d}.ids.npy", ids.astype(np.int64))
            # An id the run never trained reads as its initial row (as the store's pull).
            doc["spec"] = cfg.to_spec().to_json()
        table_docs[cfg.name] = doc
        for feat in cfg.feature_names:
            features.append({"name": feat, "table": cfg.name, "pooling": cfg.pooling})
    order = ec.feature_names
    features.sort(key=lambda f: order.index(f["name"]))  # the dense part's input order
    dense = dense_module(model)
    weights = {
        key: writer.array(f"dense/{j:03d}.npy", value.detach().cpu().numpy())
        for j, (key, value) in enumerate(dense.state_dict().items())
    }
    files: dict[str, Any] = {"dense_weights": weights}
    if job_config is not None:
        files["job_config"] = writer.json("job_config.json", job_config)
    if encoders is not None:
        files["encoders"] = writer.json("encoders.json", encoders)
    program = write_dense_program(dense, writer) if dense_program else {"file": None}
    manifest = {
        "kind": "dlrm",
        "versions": {
            "hybridrec": hybridrec_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
        },
        "source": source or {},
        "tables_dtype": tables,
        "dense_config": dataclasses.asdict(dense.config),
        "features": features,
        "tables": table_docs,
        **files,
        "dense_program": program,
    }
    writer.manifest(manifest)
    return manifest


def write_dense_program(dense: DLRMDense, writer: ExportWriter) -> dict[str, Any]:
    """``torch.export`` of ``dense`` as ``dense_program.pt2`` for consumers outside
    hybridrec, or why it could not be written (the manifest says which)."""
    cfg = dense.config
    example = (
        torch.zeros(2, cfg.num_dense),
        torch.zeros(2, cfg.num_sparse, cfg.embedding_dim),  # [B, F, D] pooled embeddings
    )
    was_training = dense.training
    try:
        dense.eval()
        batch = torch.export.Dim("batch", min=1)
        program = torch.export.export(dense, example, dynamic_shapes=({0: batch}, {0: batch}))
        path = writer.extra("dense_program.pt2")
        torch.export.save(program, path)
        return {
            "file": writer.seal("dense_program.pt2"),
            "inputs": "dense [B, num_dense] float32, sparse [B, num_sparse, D] float32",
        }
    except Exception as e:  # noqa: BLE001 - the export is an extra; its failure is recorded
        return {"file": None, "reason": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    finally:
        dense.train(was_training)
