"""The push pass's check (``ps.kernels.message_pass.push_check``) checks the parts' values
on several threads: its verdict must not depend on how many. Reference: the verdict the
rules give (ids in range, strictly increasing per part, every gradient finite), for a
good message and for one bad value placed in the first, a middle or the last part."""

from __future__ import annotations

import numpy as np
import pytest

import ps
from ps.kernels import message_pass

pytestmark = pytest.mark.timeout(60)

K, N, DIM, ROWS = 7, 40, 8, 500


@pytest.fixture(scope="module")
def message() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    if not message_pass.available():
        pytest.skip("no C compiler: the pass is not built")
    store = ps.InProcessStore()
    for i in range(K):
        opt = ps.RowWiseAdagrad(lr=0.1)
        store.create_table(ps.TableSpec(name=f"t{i}", num_rows=ROWS, dim=DIM, optimizer=opt))
    tables = [store._get(f"t{i}") for i in range(K)]  # type: ignore[attr-defined]
    index, words, _ = store._batched._describe(tables)  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    ids = np.concatenate([np.sort(rng.choice(ROWS, N, replace=False)) for _ in range(K)])
    width = message_pass.width_word(DIM, "fp32")
    toc = np.array([(index[i], N, width) for i in range(K)], dtype=np.int64)
    grads = rng.standard_normal(K * N * DIM).astype(np.float32)
    return toc, ids.astype(np.int64), grads, words


@pytest.mark.parametrize("threads", [1, 2, 4, 16])
@pytest.mark.parametrize("part", [0, K // 2, K - 1])
@pytest.mark.parametrize("bad", ["none", "nan", "inf", "id_high", "id_negative", "repeat"])
def test_the_verdict_does_not_depend_on_the_threads(
    message: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
    threads: int,
    part: int,
    bad: str,
) -> None:
    toc, ids, grads, words = (a.copy() for a in message)
    at = part * N + N // 2  # an id in the middle of the part, and its gradient row
    if bad == "nan":
        grads[at * DIM + 3] = np.nan
    elif bad == "inf":
        grads[at * DIM] = -np.inf
    elif bad == "id_high":
        ids[part * N + N - 1] = ROWS
    elif bad == "id_negative":
        ids[part * N] = -1
    elif bad == "repeat":
        ids[at] = ids[at - 1]
    got = message_pass.push_check(toc, ids, grads, words, None, threads=threads)
    assert got == (bad == "none")
