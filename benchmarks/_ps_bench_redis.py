"""Redis store pull/push rows/s beside raw Redis ceilings, for ``benchmarks/ps_bench.py``.

What one call of :func:`bench_redis` measures, on one ``redis-server`` (its own,
started on a free loopback port, unless ``url`` is given), side by side:

* ``redis_pull``: ``store.pull(table, ids)`` of 64-dim float32 rows (validation,
  bucketing, one HMGET per bucket, rows and clocks decoded into tensors);
* ``raw_mget``: the ceiling for reads: one ``MGET`` of ``batch`` string keys holding
  256-byte values (the same bytes as the rows), through redis-py's ``mget`` and
  through a hand-packed MGET (the faster of the two is the ceiling);
* ``redis_push``: ``store.push(table, ids, grads)`` with SGD (the optimizer runs
  in the generated Lua script inside Redis; ``redis_push_adagrad``: row-wise
  Adagrad, an extra figure; ``counted_*``: plain and counted pushes at ``k = 1``,
  ``_ps_bench_counted``);
* ``raw_lua``: the ceiling for updates inside Redis: a textbook Lua script doing the
  same SGD update on ``batch`` string keys of 256-byte float32 values (GET,
  ``struct.unpack`` into a table, ``w - lr * g`` per value, ``struct.pack``, SET; the
  gradients passed as one 256-byte argument per key), as one EVALSHA and as
  pipelined calls of at most 1024 keys (the faster is the ceiling). It has none of
  the store's work (bucketing, clocks, duplicate summing, validation, missing rows);
* ``raw_lua_copy``: the byte-moving floor: the same script without the arithmetic
  (GET the old value, SET the new one from the arguments). No update done inside
  Redis can be faster; in Lua 5.1, unpacking and packing 64 floats per row costs
  several times the GET/SET, so ``redis_push_vs_lua_copy`` is an extra ratio;
* ``redis_pull_bounded``: a conditional pull (``clocks``/``bound``) where every row
  is fresh (the cost of asking: clocks compared inside Redis, no rows move).

Training steps over several tables (``steps`` in the result, :func:`bench_steps`):
``step_tables`` SGD tables, ``step_ids`` Zipf ids each; one step pulls every table
and then pushes every table, either one request per table (``per_table``: all
pulls issued, then waited; then all pushes) or one ``pull_many`` and one
``push_many`` (``batched``). Figures: steps/s, and ``requests_per_server_step``,
the Redis round trips (pull + push) per node per step from the store's
``request_counts``.

Ids: batches of ``batch`` distinct Zipf(``zipf_a``) ids over ``rows`` rows; every
row of every batch exists in Redis before timing (a warm-up push). Each repeat runs
every figure once over all batches, in a rotating order; a figure's rows/s is the
rows of all batches over the median repeat time. Ratios are per repeat (the
figures ran back to back) and then the median.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

import ps
from ps.redis.conn import pack
from ps.redis.store import RedisStore

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helper modules
import _ps_bench_counted as counted  # noqa: E402
from _bench_util import (  # noqa: E402
    interleaved,
    medians,
    paired_ratio,
    repeated,
    zipf_unique_batches,
)

RAW_LUA_COPY = """
for i = 1, #KEYS do
  local old = redis.call('GET', KEYS[i])
  redis.call('SET', KEYS[i], ARGV[i])
end
return #KEYS
"""

RAW_LUA_SGD = """
local lr = tonumber(ARGV[1])
local d = tonumber(ARGV[2])
local fmt = '<' .. string.rep('f', d)
local sunpack, spack = struct.unpack, struct.pack
for i = 1, #KEYS do
  local w = {sunpack(fmt, redis.call('GET', KEYS[i]))}
  local g = {sunpack(fmt, ARGV[i + 2])}
  for j = 1, d do w[j] = w[j] - lr * g[j] end
  redis.call('SET', KEYS[i], spack(fmt, unpack(w, 1, d)))
end
return #KEYS
"""


@contextlib.contextmanager
def _server(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.support.redis_server import redis_server

    with redis_server() as srv:
        yield srv.url


def bench_steps(
    url: str,
    *,
    tables: int = 8,
    rows: int = 100_000,
    ids: int = 1_000,
    dim: int = 64,
    n_steps: int = 8,
    repeats: int = 7,
    seed: int = 0,
    buckets: int = 64,
) -> dict[str, Any]:
    """Multi-table training steps, per table vs batched (see the module docstring);
    ``{"config", "steps_per_s": {kind: ...}, "requests_per_server_step": {kind: ...},
    "batched_vs_per_table"}`` (the median per-repeat speed-up)."""
    names = [f"step{k}" for k in range(tables)]
    batches = [zipf_unique_batches(rows, ids, n_steps, 1.05, seed + k) for k in range(tables)]
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(ids, dim, generator=gen) * 1e-3 for _ in range(n_steps)]
    steps = [
        [torch.from_numpy(batches[k][s]) for k in range(tables)] for s in range(n_steps)
    ]  # [step][table] ids
    store = RedisStore(url, prefix=f"bench-steps{seed}", buckets=buckets)
    try:
        for name in names:
            spec = ps.TableSpec(name=name, num_rows=rows, dim=dim, optimizer=ps.SGD(lr=0.01))
            store.create_table(spec, exist_ok=True)
        for table_ids in steps:  # every row exists before timing
            for name, i in zip(names, table_ids, strict=True):
                store.push(name, i, grads[0])

        def per_table() -> None:
            for table_ids, g in zip(steps, grads, strict=True):
                pulls = [store.pull_async(n, i) for n, i in zip(names, table_ids, strict=True)]
                for h in pulls:
                    h.wait()
                pushes = [store.push_async(n, i, g) for n, i in zip(names, table_ids, strict=True)]
                for h in pushes:
                    h.wait()

        def batched() -> None:
            for table_ids, g in zip(steps, grads, strict=True):
                store.pull_many(
                    [ps.PullRequest(n, i) for n, i in zip(names, table_ids, strict=True)]
                )
                store.push_many(
                    [ps.PushRequest(n, i, g) for n, i in zip(names, table_ids, strict=True)]
                )

        kinds = {"per_table": per_table, "batched": batched}
        trips: dict[str, float] = {}
        for kind, fn in kinds.items():  # warm-up, and the round trips of one pass
            before = store.request_counts()
            fn()
            after = store.request_counts()
            sent = sum(after[k] - before[k] for k in ("pull_messages", "push_messages"))
            trips[kind] = sent / after["servers"] / n_steps
        times = interleaved(kinds, repeats, warmup=0, order="rotate")  # warmed up above
    finally:
        with contextlib.suppress(Exception):
            for name in names:
                store.drop_table(name)
        store.close()
    speedup = paired_ratio(times["per_table"], times["batched"])
    return {
        "config": {"tables": tables, "rows": rows, "ids": ids, "dim": dim, "steps": n_steps,
                   "repeats": repeats, "buckets": buckets},
        "steps_per_s": {k: n_steps / t for k, t in medians(times).items()},
        "requests_per_server_step": trips,
        "batched_vs_per_table": speedup,
    }  # fmt: skip


def bench_redis(
    rows: int = 1_000_000,
    dim: int = 64,
    batch: int = 10_000,
    repeats: int = 7,
    n_batches: int = 4,
    zipf_a: float = 1.05,
    seed: int = 0,
    url: str | None = None,
    buckets: int = 64,
    step_tables: int = 8,
    step_ids: int = 1_000,
) -> dict[str, Any]:
    """Measure; returns ``{"config", "figures": {name: rows_per_s}, "ratios", "steps"}``
    (``steps``: :func:`bench_steps` on the same server, ``step_tables`` tables of
    ``step_ids`` ids).

    ``ratios``: ``redis_pull_vs_mget`` (pull / best raw MGET) and
    ``redis_push_vs_lua`` (push / best raw Lua SGD update) and the extra
    ``redis_push_vs_lua_copy`` (push / the GET+SET floor), medians of per-repeat ratios.
    """
    batches = zipf_unique_batches(rows, batch, n_batches, zipf_a, seed)
    ids_t = [torch.from_numpy(b) for b in batches]
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(batch, dim, generator=gen) * 1e-3 for _ in batches]
    values = [np.random.default_rng(seed).random((batch, dim), dtype=np.float32) for _ in batches]
    prefix = f"bench{seed}"
    with _server(url) as server_url:
        store = RedisStore(server_url, prefix=prefix, buckets=buckets)
        client = redis.Redis.from_url(server_url)
        try:
            init = ps.UniformInit(low=-0.01, high=0.01, seed=seed)
            for name, opt in (("sgd", ps.SGD(lr=0.01)), ("adagrad", ps.RowWiseAdagrad(lr=0.01))):
                spec = ps.TableSpec(name=name, num_rows=rows, dim=dim, optimizer=opt, init=init)
                store.create_table(spec, exist_ok=True)
            counted.create_tables(store, rows, dim)
            keys = [[f"{prefix}:raw:{i}".encode() for i in b.tolist()] for b in batches]
            vals = [
                [v.tobytes()[k * 4 * dim : (k + 1) * 4 * dim] for k in range(batch)] for v in values
            ]
            for k, v, i, g in zip(keys, vals, ids_t, grads, strict=True):
                client.mset(dict(zip(k, v, strict=True)))
                store.push("sgd", i, g)  # every row exists before timing
                store.push("adagrad", i, g)
                for name in counted.OPTIMIZERS:
                    store.push(name, i, g)
            copy_sha = client.script_load(RAW_LUA_COPY)
            sgd_sha = client.script_load(RAW_LUA_SGD)
            grad_args = [[g[k].numpy().tobytes() for k in range(batch)] for g in grads]
            zero_clocks = [torch.full((batch,), 1 << 40, dtype=torch.int64) for _ in batches]

            def mget_redispy() -> None:
                for k in keys:
                    client.mget(k)

            def mget_packed() -> None:
                conn = client.connection_pool.get_connection()
                try:
                    for k in keys:
                        conn.send_packed_command([pack([b"MGET", *k])])
                        conn.read_response()
                finally:
                    client.connection_pool.release(conn)

            def lua(sha: str, chunk: int, sgd: bool) -> Callable[[], None]:
                def run() -> None:
                    for k, v, ga in zip(keys, vals, grad_args, strict=True):
                        p = client.pipeline(transaction=False)
                        for s in range(0, len(k), chunk):
                            kk = k[s : s + chunk]
                            args = ["0.01", dim, *ga[s : s + chunk]] if sgd else v[s : s + chunk]
                            p.evalsha(sha, len(kk), *kk, *args)
                        p.execute()

                return run

            def pull() -> None:
                for i in ids_t:
                    store.pull("sgd", i)

            def pull_bounded() -> None:
                for i, c in zip(ids_t, zero_clocks, strict=True):
                    store.pull("sgd", i, clocks=c, bound=0)

            def push() -> None:
                for i, g in zip(ids_t, grads, strict=True):
                    store.push("sgd", i, g)

            def push_adagrad() -> None:
                for i, g in zip(ids_t, grads, strict=True):
                    store.push("adagrad", i, g)

            figures: dict[str, Callable[[], None]] = {
                "raw_mget_redispy": mget_redispy,
                "raw_mget_packed": mget_packed,
                "redis_pull": pull,
                "raw_lua_one_call": lua(sgd_sha, batch, True),
                "raw_lua_chunked": lua(sgd_sha, 1024, True),
                "raw_lua_copy_one_call": lua(copy_sha, batch, False),
                "raw_lua_copy_chunked": lua(copy_sha, 1024, False),
                "redis_push": push,
                "redis_pull_bounded": pull_bounded,
                "redis_push_adagrad": push_adagrad,
            }
            for name, op in counted.push_ops(store, ids_t, grads[0]).items():
                figures[name] = repeated(op, len(ids_t))
            times = interleaved(figures, repeats, warmup=1, order="rotate")
            steps = bench_steps(
                server_url,
                tables=step_tables,
                rows=rows,
                ids=min(step_ids, rows),
                dim=dim,
                n_steps=2 * n_batches,
                repeats=repeats,
                seed=seed,
                buckets=buckets,
            )
        finally:
            with contextlib.suppress(Exception):
                for name in ("sgd", "adagrad", *counted.OPTIMIZERS):
                    store.drop_table(name)
                for k in keys:
                    client.delete(*k)
            store.close()
            client.close()
    total = batch * n_batches
    out_figures = {n: total / t for n, t in medians(times).items()}

    def best(a: str, b: str) -> list[float]:  # per round: the faster of two ways
        return [min(x, y) for x, y in zip(times[a], times[b], strict=True)]

    def ratio(ceiling: list[float], ours: str) -> float:
        return paired_ratio(ceiling, times[ours])

    best_mget = best("raw_mget_redispy", "raw_mget_packed")
    best_lua = best("raw_lua_one_call", "raw_lua_chunked")
    best_copy = best("raw_lua_copy_one_call", "raw_lua_copy_chunked")
    out_figures["raw_mget"] = total / statistics.median(best_mget)
    out_figures["raw_lua"] = total / statistics.median(best_lua)
    out_figures["raw_lua_copy"] = total / statistics.median(best_copy)
    ratios = {
        "redis_pull_vs_mget": ratio(best_mget, "redis_pull"),
        "redis_push_vs_lua": ratio(best_lua, "redis_push"),
        "redis_push_vs_lua_copy": ratio(best_copy, "redis_push"),
    }
    return {
        "config": {
            "rows": rows,
            "dim": dim,
            "batch": batch,
            "batches": n_batches,
            "repeats": repeats,
            "zipf_a": zipf_a,
            "buckets": buckets,
            "redis": "own redis-server on loopback" if url is None else "given url",
        },
        "figures": out_figures,
        "ratios": ratios,
        "steps": steps,
        "counted_k1_vs_plain": counted.ratios(times),
    }


if __name__ == "__main__":
    import json

    quick = "--quick" in sys.argv
    res = bench_redis(repeats=3 if quick else 7, n_batches=2 if quick else 4)
    for name, v in sorted(res["figures"].items()):
        print(f"{name:24s} {v:14,.0f} rows/s")
    st = res["steps"]
    for kind, v in st["steps_per_s"].items():
        trips = st["requests_per_server_step"][kind]
        print(f"step {kind:19s} {v:14,.1f} steps/s  {trips:.2f} round trips per node per step")
    print(json.dumps(res))
