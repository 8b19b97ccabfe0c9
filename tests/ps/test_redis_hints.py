"""The Redis store's hints of rows read as missing (ps/redis/hints.py): kept per id
until a push uses them, the oldest reads' ids dropped first past the limit."""

from __future__ import annotations

import numpy as np
import pytest

from ps.redis.hints import AbsentHints

pytestmark = pytest.mark.timeout(30)


def test_hints_are_used_once_and_bounded() -> None:
    hints = AbsentHints(limit=25)
    assert not hints and hints.take(np.arange(5)).size == 0
    for k in range(3):  # reads of 10 ids each: 30 > 25, the first read drops out
        hints.add(np.arange(10) + 100 * k)
    assert len(hints) == 20
    asked = np.array([0, 5, 100, 150, 205, 209, 300])  # sorted, distinct
    assert hints.take(asked).tolist() == [2, 4, 5]  # 100, 205, 209 (0 and 5 dropped out)
    assert hints.take(asked).size == 0  # used up
    assert len(hints) == 17
    hints.add(np.array([100, 7]))  # 100 again: new; 7: new
    assert hints.take(np.array([7, 100])).tolist() == [0, 1]


def test_an_id_read_again_keeps_its_age() -> None:
    hints = AbsentHints(limit=4)
    hints.add(np.array([1, 2]))
    hints.add(np.array([2, 3]))  # 2 already held: only 3 is added
    hints.add(np.array([4, 5]))  # 5 ids held: the first read ([1, 2]) drops out
    assert hints.take(np.array([1, 2, 3, 4, 5])).tolist() == [2, 3, 4]
