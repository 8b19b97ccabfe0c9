"""DLRMDense: shapes, the pairwise interaction against explicit loops, validation."""

from __future__ import annotations

import pytest
import torch

from dense import DLRMConfig, DLRMDense, pairwise_interaction


def _config(**kw: object) -> DLRMConfig:
    base: dict[str, object] = dict(
        num_dense=5, num_sparse=3, embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[6, 1]
    )
    base.update(kw)
    return DLRMConfig(**base)  # type: ignore[arg-type]


def test_pairwise_interaction_matches_double_loop() -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)  # [B, N, D]
    got = pairwise_interaction(t)
    assert got.shape == (3, 10)
    for b in range(3):
        want = []
        for i in range(5):
            for j in range(i):  # strictly lower triangle, row-major
                want.append(float(sum(t[b, i, k] * t[b, j, k] for k in range(4))))
        assert got[b].tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_forward_shapes_and_list_equals_stacked() -> None:
    torch.manual_seed(0)
    cfg = _config()
    assert cfg.num_interactions == 6 and cfg.top_input_dim == 4 + 6
    model = DLRMDense(cfg)
    dense = torch.randn(7, 5)
    sparse = [torch.randn(7, 4) for _ in range(3)]
    out_list = model(dense, sparse)
    out_stacked = model(dense, torch.stack(sparse, dim=1))
    assert out_list.shape == (7,)
    torch.testing.assert_close(out_list, out_stacked, rtol=0, atol=0)


@torch.no_grad()
def test_forward_matches_manual_composition() -> None:
    """Recompute the forward from the layers and an explicit interaction loop."""
    torch.manual_seed(1)
    cfg = _config()
    model = DLRMDense(cfg).double()
    dense = torch.randn(4, 5, dtype=torch.float64)
    sparse = torch.randn(4, 3, 4, dtype=torch.float64)
    x = model.bottom(dense)  # [B, D]
    feats = [x] + [sparse[:, f] for f in range(3)]
    rows = []
    for b in range(4):
        pairs = [float(torch.dot(feats[i][b], feats[j][b])) for i in range(4) for j in range(i)]
        rows.append(torch.cat([x[b], torch.tensor(pairs, dtype=torch.float64)]))
    want = model.top(torch.stack(rows)).squeeze(1)
    torch.testing.assert_close(model(dense, sparse), want, rtol=1e-12, atol=1e-12)


def test_gradients_flow_to_embeddings_and_layers() -> None:
    torch.manual_seed(2)
    model = DLRMDense(_config())
    sparse = torch.randn(6, 3, 4, requires_grad=True)
    model(torch.randn(6, 5), sparse).sum().backward()
    assert sparse.grad is not None and sparse.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.parameters())
    # No activation after the last top layer: logits can be negative.
    assert isinstance(model.top[-1], torch.nn.Linear)


def test_bottom_width_must_match_embedding_dim() -> None:
    with pytest.raises(ValueError, match=r"last width \(8.*embedding_dim \(4\)"):
        _config(bottom_mlp=[16, 8])


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        (dict(top_mlp=[6, 2]), r"last width must be 1.*got 2"),
        (dict(num_dense=0), r"num_dense must be an int >= 1, got 0"),
        (dict(bottom_mlp=[]), r"bottom_mlp must be a non-empty list"),
        (dict(top_mlp=[0, 1]), r"top_mlp must be a non-empty list of ints >= 1, got \[0, 1\]"),
    ],
)
def test_config_validation(kw: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _config(**kw)


def test_forward_validates_shapes() -> None:
    model = DLRMDense(_config())
    with pytest.raises(ValueError, match=r"dense features must be \[B, 5\], got shape \(2, 4\)"):
        model(torch.randn(2, 4), torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match=r"expected 3 pooled embeddings, got 2"):
        model(torch.randn(2, 5), [torch.randn(2, 4)] * 2)
    with pytest.raises(ValueError, match=r"pooled embedding 1 must be \[B, D\] = \[2, 4\]"):
        model(torch.randn(2, 5), [torch.randn(2, 4), torch.randn(2, 3), torch.randn(2, 4)])
    with pytest.raises(ValueError, match=r"\[2, 3, 4\], got shape \(2, 4, 4\)"):
        model(torch.randn(2, 5), torch.randn(2, 4, 4))
