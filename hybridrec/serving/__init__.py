"""Serving a trained DLRM: ``hybridrec export`` writes a self-contained folder
(:mod:`hybridrec.serving.export`), :class:`Predictor` scores batches from it with no
process group, no store and no pickle (or with its rows in Redis:
:func:`load_into_redis`)."""

from hybridrec.serving.artefact import ChecksumError
from hybridrec.serving.export import export_dlrm
from hybridrec.serving.predictor import Predictor
from hybridrec.serving.redis_rows import load_into_redis

__all__ = ["ChecksumError", "Predictor", "export_dlrm", "load_into_redis"]
