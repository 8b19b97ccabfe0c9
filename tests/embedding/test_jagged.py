"""KeyedJaggedIds: validation, offsets, per-key views, from_lists, sample slices."""

from __future__ import annotations

import pytest
import torch

from embedding import JaggedIds, KeyedJaggedIds

pytestmark = pytest.mark.timeout(60)


def _example() -> KeyedJaggedIds:
    # The docstring's picture: keys f1, f2; batch of 3.
    return KeyedJaggedIds(
        ["f1", "f2"],
        torch.tensor([7, 2, 4, 9, 1, 1, 3, 5, 6]),
        torch.tensor([2, 0, 1, 1, 2, 3]),
    )


def test_layout_matches_docstring() -> None:
    kjt = _example()
    assert kjt.keys == ["f1", "f2"]
    assert len(kjt) == 2 and "f1" in kjt and "f3" not in kjt
    assert kjt.batch_size == 3
    assert kjt.offsets().tolist() == [0, 2, 2, 3, 4, 6, 9]
    f1, f2 = kjt["f1"], kjt.key_slice("f2")
    assert isinstance(f1, JaggedIds)
    assert f1.ids.tolist() == [7, 2, 4] and f1.lengths.tolist() == [2, 0, 1]
    assert f1.to_lists() == [[7, 2], [], [4]]
    assert f2.to_lists() == [[9], [1, 1], [3, 5, 6]]
    assert f2.offsets().tolist() == [0, 1, 3, 6] and f2.batch_size == 3
    assert f1.weights is None


def test_from_lists_equals_constructor() -> None:
    a = KeyedJaggedIds.from_lists({"f1": [[7, 2], [], [4]], "f2": [[9], [1, 1], [3, 5, 6]]})
    b = _example()
    assert a.keys == b.keys
    assert torch.equal(a.ids, b.ids) and torch.equal(a.lengths, b.lengths)
    assert a.ids.dtype == torch.int64 and a.weights is None


def test_from_lists_weights() -> None:
    kjt = KeyedJaggedIds.from_lists(
        {"a": [[1, 2], []], "b": [[3], [4]]},
        weights={"a": [[0.5, 2.0], []], "b": [[1.0], [3.0]]},
    )
    assert kjt.weights is not None and kjt.weights.tolist() == [0.5, 2.0, 1.0, 3.0]
    b = kjt["b"]
    assert b.weights is not None and b.weights.tolist() == [1.0, 3.0]
    with pytest.raises(ValueError, match="same nesting"):
        KeyedJaggedIds.from_lists({"a": [[1, 2]]}, weights={"a": [[1.0]]})
    with pytest.raises(ValueError, match="weights keys"):
        KeyedJaggedIds.from_lists({"a": [[1]]}, weights={"b": [[1.0]]})
    with pytest.raises(ValueError, match="same number of samples"):
        KeyedJaggedIds.from_lists({"a": [[1]], "b": [[1], [2]]})


def test_validation_errors_name_the_numbers() -> None:
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="lengths add up to 2 but there are 3 ids"):
        KeyedJaggedIds(["a"], ids, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="3 lengths is not a multiple of the 2 keys"):
        KeyedJaggedIds(["a", "b"], ids, torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="lengths must be >= 0, got -1 at position 1"):
        KeyedJaggedIds(["a"], ids, torch.tensor([4, -1]))
    with pytest.raises(ValueError, match=r"duplicate keys \['a'\]"):
        KeyedJaggedIds(["a", "a"], ids, torch.tensor([1, 1, 1, 0]))
    with pytest.raises(ValueError, match=r"weights have shape \(2,\), expected \(3,\)"):
        KeyedJaggedIds(["a"], ids, torch.tensor([3]), torch.ones(2))
    with pytest.raises(TypeError, match="ids must be an int64 tensor, got torch.float32"):
        KeyedJaggedIds(["a"], ids.float(), torch.tensor([3]))
    with pytest.raises(TypeError, match="ids must be an int64 tensor, got torch.int32"):
        KeyedJaggedIds(["a"], ids.int(), torch.tensor([3]))
    with pytest.raises(TypeError, match="lengths must be an integer tensor"):
        KeyedJaggedIds(["a"], ids, torch.tensor([3.0]))
    with pytest.raises(TypeError, match="weights must be a float tensor"):
        KeyedJaggedIds(["a"], ids, torch.tensor([3]), torch.ones(3, dtype=torch.int64))
    with pytest.raises(KeyError, match="'zz' not in this batch"):
        _example()["zz"]


def test_int32_lengths_accepted() -> None:
    kjt = KeyedJaggedIds(["a"], torch.tensor([5, 6]), torch.tensor([0, 2], dtype=torch.int32))
    assert kjt.lengths.dtype == torch.int64 and kjt.offsets().tolist() == [0, 0, 2]


def test_empty_batches() -> None:
    kjt = KeyedJaggedIds.from_lists({"a": [[], []], "b": [[], []]})
    assert kjt.batch_size == 2 and kjt.ids.numel() == 0
    assert kjt["b"].to_lists() == [[], []]
    zero = KeyedJaggedIds.from_lists({"a": []})
    assert zero.batch_size == 0 and zero.offsets().tolist() == [0]


def test_sample_slice_matches_lists() -> None:
    lists = {
        "a": [[1, 2], [], [3], [4, 5, 6]],
        "b": [[7], [8, 9], [], [10]],
    }
    weights = {k: [[float(i) + 0.5 for i in s] for s in v] for k, v in lists.items()}
    kjt = KeyedJaggedIds.from_lists(lists, weights=weights)
    for start, stop in [(0, 4), (1, 3), (2, 2), (3, 4)]:
        part = kjt.sample_slice(start, stop)
        want = KeyedJaggedIds.from_lists(
            {k: v[start:stop] for k, v in lists.items()},
            weights={k: v[start:stop] for k, v in weights.items()},
        )
        assert part.batch_size == stop - start
        assert torch.equal(part.ids, want.ids) and torch.equal(part.lengths, want.lengths)
        assert part.weights is not None and want.weights is not None
        assert torch.equal(part.weights, want.weights)
    with pytest.raises(ValueError, match=r"batch_size 4, got \[3, 5\)"):
        kjt.sample_slice(3, 5)


def test_to_device_keeps_everything() -> None:
    kjt = KeyedJaggedIds.from_lists({"a": [[1], [2, 3]]}, weights={"a": [[1.0], [2.0, 3.0]]})
    moved = kjt.to("cpu")
    assert moved.keys == kjt.keys and torch.equal(moved.ids, kjt.ids)
    assert moved.weights is not None and torch.equal(moved.weights, kjt.weights)  # type: ignore[arg-type]


# ---------------------------------------------------------------- by key, dedup


def _weighted() -> KeyedJaggedIds:
    return KeyedJaggedIds.from_lists(
        {"f1": [[7, 2], [], [4]], "f2": [[9], [1, 1], [3, 5, 6]]},
        weights={"f1": [[0.1, 0.2], [], [0.3]], "f2": [[1.0], [2.0, 3.0], [4.0, 5.0, 6.0]]},
    )


def test_select_permute_split_concat_roundtrip() -> None:
    kjt = _weighted()
    assert kjt.ids_per_key().tolist() == [3, 6]
    assert kjt.select(kjt.keys) is kjt
    f2 = kjt.select(["f2"])
    assert f2.keys == ["f2"] and f2.ids.tolist() == [9, 1, 1, 3, 5, 6]
    assert f2.lengths.tolist() == [1, 2, 3] and f2.batch_size == 3
    assert f2.weights is not None and f2.weights.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    p = kjt.permute(["f2", "f1"])
    assert p.keys == ["f2", "f1"] and p.ids.tolist() == [9, 1, 1, 3, 5, 6, 7, 2, 4]
    assert p.lengths.tolist() == [1, 2, 3, 2, 0, 1]
    assert p["f1"].to_lists() == kjt["f1"].to_lists()
    a, b = kjt.split([["f2"], ["f1"]])
    back = KeyedJaggedIds.concat([b, a])
    assert back.keys == kjt.keys
    assert torch.equal(back.ids, kjt.ids) and torch.equal(back.lengths, kjt.lengths)
    assert back.weights is not None and kjt.weights is not None
    assert torch.equal(back.weights, kjt.weights)
    assert kjt.select([]).keys == []


def test_by_key_errors() -> None:
    kjt = _weighted()
    with pytest.raises(KeyError, match=r"keys \['f9'\] not in this batch"):
        kjt.select(["f9"])
    with pytest.raises(ValueError, match="not a permutation"):
        kjt.permute(["f1"])
    with pytest.raises(ValueError, match=r"keys \['f1'\] are in more than one group"):
        kjt.split([["f1"], ["f1", "f2"]])
    other = KeyedJaggedIds.from_lists({"g": [[1]]})
    with pytest.raises(ValueError, match=r"different batch sizes \[3, 1\]"):
        KeyedJaggedIds.concat([kjt, other])
    with pytest.raises(ValueError, match=r"keys \['f1'\] appear in more than one batch"):
        KeyedJaggedIds.concat([kjt.select(["f1"]), kjt.select(["f1"])])
    plain = KeyedJaggedIds.from_lists({"g": [[1], [], [2]]})
    with pytest.raises(ValueError, match="either every batch has weights or none does"):
        KeyedJaggedIds.concat([kjt, plain])
    with pytest.raises(ValueError, match="needs at least one"):
        KeyedJaggedIds.concat([])


def test_to_and_pin_memory() -> None:
    kjt = _weighted()
    same = kjt.to("cpu")
    assert torch.equal(same.ids, kjt.ids) and same.keys == kjt.keys
    pinned = kjt.pin_memory()
    assert torch.equal(pinned.ids, kjt.ids) and torch.equal(pinned.lengths, kjt.lengths)
    if not torch.cuda.is_available():
        assert pinned is kjt  # nothing to pin for: the same batch
        return
    assert pinned.ids.is_pinned() and pinned.lengths.is_pinned()
    assert pinned.weights is not None and pinned.weights.is_pinned()


def test_dedup_per_table() -> None:
    from embedding.dedup import dedup_per_table

    kjt = KeyedJaggedIds.from_lists(
        {"clicked": [[7, 2], [7]], "bought": [[2], [9]], "u": [[1], []]}
    )
    got = dedup_per_table(kjt, {"items": ["clicked", "bought"], "users": ["u"], "none": ["zz"]})
    assert list(got) == ["items", "users"]
    items = got["items"]
    assert items.unique.tolist() == [2, 7, 9] and items.inverse.tolist() == [1, 0, 1, 0, 2]
    assert items.features == ["clicked", "bought"] and items.sizes == [3, 2]
    ids = torch.cat([kjt["clicked"].ids, kjt["bought"].ids])
    assert torch.equal(items.unique[items.inverse], ids)


def test_bucketize_by_rank_delegates_to_jagged_dist() -> None:
    from embedding import TableConfig
    from embedding.jagged_dist import bucketize
    from embedding.sharding_plan import ShardingPlan

    cfgs = [
        TableConfig(name="a", num_rows=10, dim=2, feature_names=["x", "y"], placement="sharded"),
        TableConfig(name="b", num_rows=10, dim=2, feature_names=["z"], placement="sharded"),
    ]
    plan = ShardingPlan.build(cfgs, 2, row_wise_threshold_rows=5)
    kjt = KeyedJaggedIds.from_lists({"x": [[7, 2], [7]], "y": [[9], []], "z": [[1, 6], [8]]})
    got = kjt.bucketize_by_rank(plan, {"a": ["x", "y"], "b": ["z"]})
    want = bucketize(plan, ["a", "b"], [torch.tensor([2, 7, 9]), torch.tensor([1, 6, 8])])
    assert torch.equal(got.send_ids, want.send_ids) and torch.equal(got.counts, want.counts)
    with pytest.raises(ValueError, match="no feature of table 'c'"):
        kjt.bucketize_by_rank(plan, {"c": ["w"]})
