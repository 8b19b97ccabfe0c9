"""The errors of a table's lifecycle, shared by every store.

``Store.create_table(spec, exist_ok=...)`` finds one of three cases:

* no table of that name: it is created;
* a table with an equal spec (every field of :class:`ps.TableSpec`: rows, dim,
  optimizer and its hyperparameters, init, eviction, NaN policy): opened with
  ``exist_ok=True``, else :class:`TableExistsError`;
* a table with another spec: :class:`TableSpecMismatch` whatever ``exist_ok``,
  naming both shapes and how to clear the old table.

Both are ValueErrors, so callers that caught the old "already exists" ValueError
keep working.
"""

from __future__ import annotations

from typing import Any

from ps.table import TableSpec

_EXTRA_FIELDS = ("init", "capacity", "max_age_steps", "nan_policy")


class TableExistsError(ValueError):
    """``create_table`` without ``exist_ok`` found the table already there (same spec)."""


class TableSpecMismatch(ValueError):
    """``create_table`` found the table already there with another spec."""


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return "(" + ", ".join(_value(x) for x in v) + ")"
    return repr(v) if isinstance(v, str) else str(v)


def describe_spec(spec: TableSpec, *, extra: tuple[str, ...] = ()) -> str:
    """A one-line shape: ``"100000 x 16 rowwise_adagrad(lr=0.05, eps=1e-08)"``.

    ``num_rows`` None reads ``dynamic``; ``extra`` names further spec fields to add
    (those that differ between two specs).
    """
    opt = spec.optimizer.to_json()
    kind = opt.pop("type")
    hyper = ", ".join(f"{k}={_value(v)}" for k, v in opt.items())
    rows = "dynamic" if spec.num_rows is None else str(spec.num_rows)
    text = f"{rows} x {spec.dim} {kind}({hyper})"
    js = spec.to_json()
    for name in extra:
        v = js[name]
        if isinstance(v, dict):
            v = "(" + ", ".join(f"{k}={_value(x)}" for k, x in v.items()) + ")"
        else:
            v = _value(v)
        text += f", {name}={v}"
    return text


def check_existing(
    old: TableSpec | None, spec: TableSpec, *, exist_ok: bool, where: str, clear: str
) -> bool:
    """Decide a ``create_table``: True to create, False to open the existing table.

    ``old``: the spec the store already holds under ``spec.name`` (None: none);
    ``where`` names the store in messages (``"in the in-process store"``, ``"on
    Redis 127.0.0.1:6379 (db 0, prefix 'hybridrec')"``); ``clear`` says how to remove the
    old table besides ``drop_table``. Raises :class:`TableExistsError` or
    :class:`TableSpecMismatch` as the module docstring says.
    """
    if old is None:
        return True
    a, b = old.to_json(), spec.to_json()
    if a != b:
        differ = tuple(f for f in _EXTRA_FIELDS if a[f] != b[f])
        raise TableSpecMismatch(
            f"create_table: table {spec.name!r} already exists {where} as "
            f"{describe_spec(old, extra=differ)}, but this job asks for "
            f"{describe_spec(spec, extra=differ)}; remove the old table with "
            f"store.drop_table({spec.name!r}) ({clear}), or use another table name"
        )
    if not exist_ok:
        raise TableExistsError(
            f"create_table: table {spec.name!r} already exists {where} "
            f"({describe_spec(old)}); pass exist_ok=True to open it, or remove it with "
            f"store.drop_table({spec.name!r}) ({clear})"
        )
    return False
