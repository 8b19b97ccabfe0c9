"""A worker of the Redis concurrency test: push known gradients to a shared table.

The test runs :func:`push_worker` on several threads, each with its own client
(connection, worker id, session), started together. As a script, ``python
ps_redis_worker.py URL PREFIX WORKER [GO_FILE]`` does the same in a process of its own
(waiting for the go file if given) and prints ``worker W: ok``.

The gradients are multiples of 1/8 and the table's SGD learning rate a power of
two, with rows starting in (-0.5, 0.5): every partial sum is exact in float32, so
the final rows do not depend on the order in which Redis applied the pushes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import ps
from ps.redis.store import RedisStore

ROWS, DIM = 500, 4
PUSHES, PER_PUSH = 20, 500  # 10 000 gradient rows per worker
LR = 2.0**-8
TABLE = "shared"


def table_spec() -> ps.TableSpec:
    init = ps.UniformInit(low=-0.5, high=0.5, seed=7)
    return ps.TableSpec(name=TABLE, num_rows=ROWS, dim=DIM, optimizer=ps.SGD(lr=LR), init=init)


def worker_pushes(worker: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The pushes of ``worker``: ids ``[PER_PUSH]`` (repeats included), grads in k/8."""
    gen = torch.Generator().manual_seed(1000 + worker)
    for _ in range(PUSHES):
        ids = torch.randint(0, ROWS, (PER_PUSH,), generator=gen)
        grads = torch.randint(-4, 5, (PER_PUSH, DIM), generator=gen).float() / 8
        yield ids, grads


def push_worker(url: str, prefix: str, worker: int, start: Callable[[], object]) -> None:
    """Open the table (``exist_ok``), wait for ``start()`` (all workers begin together),
    push :func:`worker_pushes` with every push in flight at once, wait for all."""
    store = RedisStore(url, prefix=prefix)
    try:
        store.create_table(table_spec(), exist_ok=True)
        start()
        pending = [store.push_async(TABLE, ids, g) for ids, g in worker_pushes(worker)]
        for h in pending:
            h.wait()
    finally:
        store.close()


def main() -> None:
    url, prefix, worker = sys.argv[1], sys.argv[2], int(sys.argv[3])
    go = Path(sys.argv[4]) if len(sys.argv) > 4 else None

    def wait_for_go() -> None:
        deadline = time.monotonic() + 60
        while go is not None and not go.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {worker}: no go signal at {go}")
            time.sleep(0.01)

    push_worker(url, prefix, worker, wait_for_go)
    print(f"worker {worker}: ok", flush=True)


if __name__ == "__main__":
    main()
