"""DLRMDense: shapes, the pairwise interaction against explicit loops, validation."""

from __future__ import annotations

import pytest
import torch

from dense import DLRMConfig, DLRMDense, pairwise_interaction
from dense.dlrm import AlignedLinear, _interact, naive_pairwise_interaction
from dense.kernels import interaction as interaction_kernel


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


@pytest.mark.parametrize("n", [1, 2, 5, 27])
def test_fast_interaction_equals_naive_forward_and_backward(n: int) -> None:
    """The one-bmm backward equals autograd through the full bmm and advanced indexing."""
    g = torch.Generator().manual_seed(n)
    t = torch.randn(6, n, 8, generator=g, dtype=torch.float64)
    upstream = torch.randn(6, n * (n - 1) // 2, generator=g, dtype=torch.float64)
    fast_in = t.clone().requires_grad_(True)
    naive_in = t.clone().requires_grad_(True)
    fast = pairwise_interaction(fast_in)
    naive = naive_pairwise_interaction(naive_in)
    torch.testing.assert_close(fast, naive, rtol=0, atol=0)  # same bmm, same entries
    (fast * upstream).sum().backward()
    (naive * upstream).sum().backward()
    assert fast_in.grad is not None and naive_in.grad is not None
    torch.testing.assert_close(fast_in.grad, naive_in.grad, rtol=1e-12, atol=1e-12)


def _naive_dense_forward(
    model: DLRMDense, dense: torch.Tensor, sparse: torch.Tensor
) -> torch.Tensor:
    """DLRMDense's forward from plain nn.Linear layers: no padding, no custom autograd."""

    def run(seq: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        for layer in seq:
            if isinstance(layer, torch.nn.Linear):
                x = torch.nn.functional.linear(x, layer.weight, layer.bias)
            else:
                x = torch.relu(x)
        return x

    x = run(model.bottom, dense)  # [B, D]
    t = torch.cat([x.unsqueeze(1), sparse], dim=1)  # [B, F+1, D]
    return run(model.top, torch.cat([x, naive_pairwise_interaction(t)], dim=1)).squeeze(1)


@pytest.mark.parametrize("as_list", [False, True])
def test_dense_step_gradients_equal_naive_model(as_list: bool) -> None:
    """Aligned layers + fused interaction give the naive model's logits and gradients."""
    torch.manual_seed(3)
    cfg = _config(num_dense=13, num_sparse=4, embedding_dim=8, bottom_mlp=[16, 8], top_mlp=[7, 1])
    assert cfg.top_input_dim % 8 != 0 and cfg.num_dense % 8 != 0  # both first layers padded
    model = DLRMDense(cfg).double()
    dense = torch.randn(5, 13, dtype=torch.float64)
    sparse = torch.randn(5, 4, 8, dtype=torch.float64)
    fast_sp = sparse.clone().requires_grad_(True)
    naive_sp = sparse.clone().requires_grad_(True)
    fast_arg = list(fast_sp.unbind(1)) if as_list else fast_sp
    fast = model(dense, fast_arg)
    fast.pow(2).sum().backward()
    fast_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    naive = _naive_dense_forward(model, dense, naive_sp)
    naive.pow(2).sum().backward()
    naive_grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch.testing.assert_close(fast, naive, rtol=1e-12, atol=1e-12)
    assert len(fast_grads) == len(naive_grads) == len(list(model.parameters()))
    for a, b in zip(fast_grads, naive_grads, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fast_sp.grad, naive_sp.grad, rtol=1e-12, atol=1e-12)


def test_aligned_layers_keep_linear_state_dict() -> None:
    model = DLRMDense(_config(num_dense=13))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["bottom.0.weight"] == (8, 13) and shapes["top.0.weight"] == (6, 10)
    assert isinstance(model.bottom[0], AlignedLinear) and model.bottom[0].padded_in == 16


@pytest.mark.skipif(not interaction_kernel.usable(torch.zeros(1, 1, 1)), reason="no C compiler")
@pytest.mark.parametrize(
    "b, n, d, with_first",
    [(3, 1, 8, True), (5, 2, 3, False), (7, 6, 13, True), (70, 27, 64, True), (66, 9, 72, False)],
)
def test_interaction_kernel_equals_float64_reference(
    b: int, n: int, d: int, with_first: bool
) -> None:
    """The float32 C kernel (forward and backward) against the float64 torch path."""
    g = torch.Generator().manual_seed(b * n + d)
    t = torch.randn(b, n, d, generator=g)
    pairs = n * (n - 1) // 2
    width = (d if with_first else 0) + pairs + 5  # 5 zero columns of padding
    upstream = torch.randn(b, width, generator=g)
    fast_in = t.clone().requires_grad_(True)
    ref_in = t.double().requires_grad_(True)
    fast = _interact(fast_in, with_first=with_first, width=width)
    ref = _interact(ref_in, with_first=with_first, width=width)
    assert fast.dtype == torch.float32 and fast.shape == (b, width)
    torch.testing.assert_close(fast.double(), ref, rtol=1e-5, atol=1e-5)
    assert bool((fast[:, width - 5 :] == 0).all())
    (fast * upstream).sum().backward()
    (ref * upstream.double()).sum().backward()
    assert fast_in.grad is not None and ref_in.grad is not None
    torch.testing.assert_close(fast_in.grad.double(), ref_in.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("as_list", [False, True])
def test_float32_model_uses_kernel_and_matches_float64(as_list: bool) -> None:
    """A whole float32 DLRMDense step (kernel path where built: the stacked input, or
    the list read in place) against float64."""
    torch.manual_seed(5)
    cfg = _config(num_dense=13, num_sparse=26, embedding_dim=16, bottom_mlp=[32, 16])
    model = DLRMDense(cfg)
    ref = DLRMDense(cfg).double()
    ref.load_state_dict(model.state_dict())
    dense, sparse = torch.randn(80, 13), torch.randn(80, 26, 16)
    sp32, sp64 = sparse.clone().requires_grad_(True), sparse.double().requires_grad_(True)
    out32 = model(dense, list(sp32.unbind(1)) if as_list else sp32)
    out64 = ref(dense.double(), sp64)
    torch.testing.assert_close(out32.double(), out64, rtol=1e-4, atol=1e-4)
    out32.sum().backward()
    out64.sum().backward()
    assert sp32.grad is not None and sp64.grad is not None
    torch.testing.assert_close(sp32.grad.double(), sp64.grad, rtol=1e-4, atol=1e-4)
