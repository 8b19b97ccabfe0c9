"""``Predictor(MODEL_DIR)``: click probabilities from an export, without a process group,
a store or any pickle.

Loading checks every file's size and sha256 against the manifest, memory-maps the row
files and rebuilds the dense part from its config and ``.npy`` weights. ``predict``
looks up and dequantizes only the rows a batch names, pools them per feature as the
training model does and runs the dense part::

    batch.sparse (K features, B samples) --lookup + pool--> K x [B, D]
    batch.dense [B, num_dense] ---------------------------> DLRMDense -> logits [B] -> sigmoid
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dense import DLRMConfig, DLRMDense
from embedding import KeyedJaggedIds
from hybridrec.datasets.ctr import Batch
from hybridrec.datasets.encode import Encoders, Row
from hybridrec.serving.artefact import ExportReader
from hybridrec.serving.tables import ServingTable


class Predictor:
    """A loaded export. ``predict(batch)`` -> probabilities float32 ``[B]``.

    ``device``: where the dense part runs (rows are looked up on the host and moved in
    one copy per feature). ``verify``: check every file's sha256 (the sizes are always
    checked); off, loading reads nothing of the row files but their headers."""

    def __init__(self, folder: str | Path, device: str | torch.device = "cpu", verify: bool = True):
        self.reader = ExportReader.open(folder, verify=verify)
        m = self.reader.manifest
        if m.get("kind") != "dlrm":
            raise ValueError(f"{folder}: an export of a {m.get('kind')!r} model, not a DLRM")
        self.device = torch.device(device)
        self.manifest = m
        self.features: list[dict[str, Any]] = list(m["features"])  # the dense part's order
        self.feature_names = [f["name"] for f in self.features]
        self.tables = {
            name: ServingTable.open(self.reader, name, doc) for name, doc in m["tables"].items()
        }
        self.config = DLRMConfig(**m["dense_config"])
        self.dense = self._dense(m["dense_weights"])
        self.encoders = (
            Encoders.from_state(self.reader.json(m["encoders"])) if m.get("encoders") else None
        )

    def _dense(self, files: dict[str, str]) -> DLRMDense:
        """The dense part rebuilt from its config, its weights from the ``.npy`` files."""
        with torch.device("meta"):  # shapes only: the weights come from the files
            dense = DLRMDense(self.config)
        state = {k: torch.from_numpy(self.reader.array(f)) for k, f in files.items()}
        dense.load_state_dict(state, strict=True, assign=True)
        dense.requires_grad_(False)
        return dense.eval().to(self.device)

    @property
    def num_dense(self) -> int:
        return self.config.num_dense

    def table_bytes(self) -> int:
        """Bytes of every table's row files (what a row format changes)."""
        return sum(t.nbytes for t in self.tables.values())

    # ------------------------------------------------------------ scoring

    def _check(self, sparse: KeyedJaggedIds, dense: torch.Tensor) -> None:
        if not isinstance(sparse, KeyedJaggedIds):
            raise TypeError(f"predict: sparse ids must be a KeyedJaggedIds, got {type(sparse)}")
        unknown = [k for k in sparse.keys if k not in self.feature_names]
        if unknown:
            raise ValueError(
                f"predict: unknown feature {unknown[0]!r}; this model's features are "
                f"{self.feature_names}"
            )
        missing = [f for f in self.feature_names if f not in sparse]
        if missing:
            raise ValueError(
                f"predict: the batch lacks the features {missing} (every one is needed)"
            )
        if not isinstance(dense, torch.Tensor) or dense.dtype != torch.float32:
            what = dense.dtype if isinstance(dense, torch.Tensor) else type(dense).__name__
            raise TypeError(f"predict: dense features must be a float32 tensor, got {what}")
        want = (sparse.batch_size, self.num_dense)
        if dense.dim() != 2 or tuple(dense.shape) != want:
            raise ValueError(
                f"predict: dense features must be [B, num_dense] = {list(want)} for this "
                f"batch of {sparse.batch_size}, got shape {tuple(dense.shape)}"
            )

    @torch.inference_mode()
    def logits(
        self, batch: Batch | KeyedJaggedIds, dense: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits float32 ``[B]`` of a :class:`Batch`, or of sparse ids and ``dense [B, n]``."""
        if isinstance(batch, Batch):
            sparse, dense = batch.sparse, batch.dense
        else:
            sparse = batch
            if dense is None:
                raise TypeError("predict: give a Batch, or sparse ids and dense features")
        self._check(sparse, dense)
        pooled = []  # per feature, in the dense part's order: [B, D]
        for f in self.features:
            table = self.tables[f["table"]]
            bag = sparse.key_slice(f["name"])
            table.check_ids(f["name"], bag.ids)
            pooled.append(table.pool(bag, f["pooling"]).to(self.device))
        return self.dense(dense.to(self.device), pooled)

    def predict(
        self, batch: Batch | KeyedJaggedIds, dense: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Click probabilities float32 ``[B]`` (on ``device``)."""
        return torch.sigmoid(self.logits(batch, dense))

    def encode(self, rows: list[Row]) -> Batch:
        """Raw rows (label, dense numbers, each sparse column's values) encoded as the run
        encoded its data (:meth:`hybridrec.datasets.encode.Encoders.batch`)."""
        if self.encoders is None:
            raise ValueError(
                "predict_rows: this export has no data encoders (its run read a data set "
                "whose ids are made by its reader, e.g. synthetic or Criteo); use predict"
            )
        names = [e.name for e in self.encoders.sparse]
        if sorted(names) != sorted(self.feature_names):
            raise ValueError(
                f"predict_rows: encoders for {names}, model features {self.feature_names}"
            )
        for i, row in enumerate(rows):
            if (
                len(row) != 3
                or len(row[1]) != len(self.encoders.dense)
                or len(row[2]) != len(names)
            ):
                raise ValueError(
                    f"predict_rows: row {i} must be (label, {len(self.encoders.dense)} dense "
                    f"numbers, {len(names)} sparse bags {names}), got {row!r}"[:400]
                )
        return self.encoders.batch(rows)

    def predict_rows(self, rows: list[Row]) -> torch.Tensor:
        """Probabilities ``[B]`` of raw tabular rows through the saved encoders."""
        return self.predict(self.encode(rows))
