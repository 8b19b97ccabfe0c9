"""Bad input to an EmbeddingCollection (local and hybrid placements): every error names
the feature, the table and the numbers, and nothing changes in the tables."""

from __future__ import annotations

import pytest
import torch

import ps
from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig

pytestmark = pytest.mark.timeout(60)

PLACEMENTS = ["local", "hybrid"]


def _collection(placement: str) -> EmbeddingCollection:
    return EmbeddingCollection(
        [
            TableConfig(
                name="t", num_rows=5, dim=2, feature_names=["x", "y"], pooling="mean",
                placement=placement, optimizer=ps.SGD(lr=1.0),  # type: ignore[arg-type]
            ),
            TableConfig(
                name="s", num_rows=3, dim=2, feature_names=["seq"], pooling="none",
                placement=placement, optimizer=ps.SGD(lr=1.0),  # type: ignore[arg-type]
            ),
        ]
    )  # fmt: skip


def _snapshot(ec: EmbeddingCollection) -> list[torch.Tensor]:
    return [ec.rows("t", torch.arange(5)), ec.rows("s", torch.arange(3))]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_bad_batches_raise_and_change_nothing(placement: str) -> None:
    ec = _collection(placement)
    before = _snapshot(ec)
    with pytest.raises(
        ValueError, match=r"feature 'z' is not in any table; known features: \['x', 'y', 'seq'\]"
    ):
        ec(KeyedJaggedIds.from_lists({"z": [[1]]}))
    with pytest.raises(
        ValueError,
        match=r"feature 'y' has id 5, out of range for table 't' with 5 rows "
        r"\(valid ids \[0, 5\)\)",
    ):
        ec(KeyedJaggedIds.from_lists({"x": [[1], [4]], "y": [[0], [5]]}))
    with pytest.raises(ValueError, match=r"feature 'x' has id -1, out of range for table 't'"):
        ec(KeyedJaggedIds.from_lists({"x": [[-1]]}))
    with pytest.raises(ValueError, match=r"feature 'seq' has id 3, out of range for table 's'"):
        ec(KeyedJaggedIds.from_lists({"seq": [[0, 3]]}))
    with pytest.raises(
        ValueError, match=r"table 't' \(features \['x'\]\) pools with 'mean'; weights need"
    ):
        ec(KeyedJaggedIds.from_lists({"x": [[1]]}, weights={"x": [[2.0]]}))
    with pytest.raises(
        ValueError, match=r"feature 'seq' of table 's' has pooling='none'.*lengths \[1, 2\]"
    ):
        ec(KeyedJaggedIds.from_lists({"seq": [[1], [1, 2]]}))
    with pytest.raises(TypeError, match="expected a KeyedJaggedIds"):
        ec({"x": torch.tensor([1])})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected a KeyedJaggedIds"):
        ec.prefetch({"x": torch.tensor([1])})  # type: ignore[arg-type]
    # A bad batch during training leaves no half-done update behind either.
    with pytest.raises(ValueError, match="out of range"):
        ec(KeyedJaggedIds.from_lists({"x": [[1]], "y": [[7]]}))
    after = _snapshot(ec)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


def test_malformed_jagged_batches() -> None:
    with pytest.raises(TypeError, match="ids must be an int64 tensor, got torch.int32"):
        KeyedJaggedIds(["x"], torch.tensor([1, 2], dtype=torch.int32), torch.tensor([2]))
    with pytest.raises(TypeError, match="lengths must be an integer tensor, got torch.float32"):
        KeyedJaggedIds(["x"], torch.tensor([1, 2]), torch.tensor([2.0]))
    with pytest.raises(TypeError, match="weights must be a float tensor"):
        KeyedJaggedIds(["x"], torch.tensor([1, 2]), torch.tensor([2]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="lengths add up to 3 but there are 2 ids"):
        KeyedJaggedIds(["x"], torch.tensor([1, 2]), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"weights have shape \(1,\), expected \(2,\)"):
        KeyedJaggedIds(["x"], torch.tensor([1, 2]), torch.tensor([2]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="3 lengths is not a multiple of the 2 keys"):
        KeyedJaggedIds(["x", "y"], torch.tensor([1, 2]), torch.tensor([1, 1, 0]))
    with pytest.raises(ValueError, match="lengths must be >= 0, got -1 at position 1"):
        KeyedJaggedIds(["x", "y"], torch.tensor([1]), torch.tensor([2, -1]))


def test_collection_arguments() -> None:
    cfg = TableConfig(name="t", num_rows=5, dim=2, feature_names=["x"])
    with pytest.raises(ValueError, match="needs at least one TableConfig"):
        EmbeddingCollection([])
    with pytest.raises(TypeError, match="tables must be TableConfig, got dict"):
        EmbeddingCollection([{"name": "t"}])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="table name 't' appears twice"):
        EmbeddingCollection([cfg, cfg])
    with pytest.raises(TypeError):
        EmbeddingCollection([cfg], ps.InProcessStore())  # type: ignore[misc]
    ec = EmbeddingCollection([cfg])
    with pytest.raises(KeyError, match="no table 'u'"):
        ec.rows("u", torch.tensor([0]))
    with pytest.raises(ValueError, match=r"table 't': ids must be in \[0, 5\), got range"):
        ec.rows("t", torch.tensor([5]))
