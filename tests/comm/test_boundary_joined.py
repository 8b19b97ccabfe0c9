"""``comm.boundary.joined``: back-to-back parts become one view; anything else one copy.

The reference is ``torch.cat`` of the same parts; a view is proved by a write through it
reaching the parts' storage.
"""

from __future__ import annotations

import pytest
import torch

from comm import boundary


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("shape", [(10,), (10, 3), (10, 2, 4)])
@pytest.mark.parametrize("sizes", [[10], [3, 7], [0, 4, 0, 6], [1, 1, 8]])
def test_split_parts_are_joined_as_a_view(shape: tuple[int, ...], sizes: list[int]) -> None:
    whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    parts = list(whole.split(sizes))
    got = boundary.joined(parts)
    assert torch.equal(got, torch.cat(parts)) and got.shape == whole.shape
    assert _shares(got, whole)
    got[-1] = -1.0  # a view: the write lands in the parts' storage
    assert bool((whole[-1] == -1.0).all())


def test_a_tail_of_a_larger_tensor_keeps_its_offset() -> None:
    whole = torch.arange(24, dtype=torch.int64).reshape(8, 3)
    parts = [whole[2:4], whole[4:5], whole[5:8]]
    got = boundary.joined(parts)
    assert torch.equal(got, whole[2:]) and _shares(got, whole)


@pytest.mark.parametrize(
    "case", ["apart", "out_of_order", "gap", "strided", "other_dtype", "other_width"]
)
def test_parts_not_back_to_back_are_concatenated(case: str) -> None:
    whole = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    parts = {
        "apart": [whole[:4], whole[4:].clone()],
        "out_of_order": [whole[4:], whole[:4]],
        "gap": [whole[:3], whole[4:]],
        "strided": [whole[:4, :2], whole[4:, :2]],
        "other_dtype": [whole[:4], whole[4:].double()],
        "other_width": [whole[:4], torch.zeros(2, 4)],
    }[case]
    if case == "other_width":
        with pytest.raises(RuntimeError):
            boundary.joined(parts)
        return
    got = boundary.joined(parts)
    assert torch.equal(got, torch.cat(parts))
    assert not _shares(got, whole)


def test_one_part_is_itself() -> None:
    t = torch.arange(6).reshape(2, 3)[:, :2]  # strided: returned as it is, not copied
    assert boundary.joined([t]) is t
