"""hybridrec: run training jobs on the five packages (comm, ps, cache, embedding, dense).

What a user imports: the training loop, whole-model checkpoints and resume, config
dataclasses and their command line, launch roles and store selection, data readers, and
the DLRM and GPT jobs built from them::

    from hybridrec import Trainer, TrainerConfig, save_model, load_model, Launch

The names below load their module on first use, so ``hybridrec --help`` stays quick
(no torch import).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridrec.launch import Launch
    from hybridrec.model_state import load_model, save_model
    from hybridrec.trainer import Trainer, TrainerConfig

_HOMES = {
    "Trainer": "hybridrec.trainer",
    "TrainerConfig": "hybridrec.trainer",
    "save_model": "hybridrec.model_state",
    "load_model": "hybridrec.model_state",
    "Launch": "hybridrec.launch",
}

__all__ = ["Launch", "Trainer", "TrainerConfig", "load_model", "save_model"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'hybridrec' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
