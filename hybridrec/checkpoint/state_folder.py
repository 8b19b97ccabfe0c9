"""Nested state (dicts, also with int keys, lists, tuples, tensors, JSON scalars) as a
folder: ``index.json`` holds a JSON skeleton, each tensor is one ``.npy`` file.

No pickle either way: ``np.save(..., allow_pickle=False)`` and ``np.load(...,
allow_pickle=False)``, so an object array is refused, never unpickled. bfloat16
tensors are stored as their int16 bits (numpy has no bfloat16).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch


def flatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` -> a JSON skeleton; its tensors go to ``tensors`` under numbered names."""
    if isinstance(obj, torch.Tensor):
        name = f"{len(tensors):06d}"
        tensors[name] = obj.detach().cpu()
        return {"__tensor__": name}
    if isinstance(obj, Mapping):  # keys may be ints (optimizer state): keep their type
        return {"__dict__": [[k, flatten(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [flatten(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [flatten(v, tensors) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"checkpoint: cannot store a {type(obj).__name__} ({obj!r}) without pickle")


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of :func:`flatten`."""
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__dict__" in skeleton:
            return {k: unflatten(v, tensors) for k, v in skeleton["__dict__"]}
        if "__tuple__" in skeleton:
            return tuple(unflatten(v, tensors) for v in skeleton["__tuple__"])
        raise ValueError(f"checkpoint: unknown skeleton entry {sorted(skeleton)}")
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    return skeleton


def write_state(folder: Path, obj: Any) -> None:
    """Write nested state as ``folder/index.json`` + one ``.npy`` per tensor."""
    folder.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = flatten(obj, tensors)
    dtypes = {}
    for name, t in tensors.items():
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: keep the bits
            arr, dtypes[name] = t.view(torch.int16).numpy(), "bfloat16"
        else:
            arr, dtypes[name] = t.contiguous().numpy(), str(t.dtype).removeprefix("torch.")
        np.save(folder / f"{name}.npy", arr, allow_pickle=False)
    doc = {"skeleton": skeleton, "dtypes": dtypes}
    (folder / "index.json").write_text(json.dumps(doc), encoding="utf-8")


def read_state(folder: Path) -> Any:
    """Read what :func:`write_state` wrote (never unpickles: object arrays are refused)."""
    doc = json.loads((folder / "index.json").read_text(encoding="utf-8"))
    tensors = {}
    for name, dtype in doc["dtypes"].items():
        if not name.isdigit():
            raise ValueError(f"checkpoint {folder}: bad tensor name {name!r}")
        t = torch.from_numpy(np.load(folder / f"{name}.npy", allow_pickle=False).copy())
        tensors[name] = t.view(torch.bfloat16) if dtype == "bfloat16" else t
    return unflatten(doc["skeleton"], tensors)
