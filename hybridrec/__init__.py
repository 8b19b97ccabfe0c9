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
    from hybridrec.checkpoint.model_state import load_model, save_model
    from hybridrec.launch.roles import Launch
    from hybridrec.train.loop import Trainer, TrainerConfig

_HOMES = {
    "Trainer": "hybridrec.train.loop",
    "TrainerConfig": "hybridrec.train.loop",
    "save_model": "hybridrec.checkpoint.model_state",
    "load_model": "hybridrec.checkpoint.model_state",
    "Launch": "hybridrec.launch.roles",
}

__all__ = ["Launch", "Trainer", "TrainerConfig", "load_model", "save_model"]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'hybridrec' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
