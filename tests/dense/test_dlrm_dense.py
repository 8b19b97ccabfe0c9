"""DLRMDense: shapes, the pairwise interaction against explicit loops, validation."""

from __future__ import annotations

import copy

import pytest
import torch

from dense import DLRMConfig, DLRMDense, pairwise_interaction
from dense.dlrm import AlignedLinear, _interact
from dense.kernels import interaction as interaction_kernel
from tolerance import assert_close, assert_same, gamma, sum_tol

pytestmark = pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY

F64 = torch.float64
BOUND = "Higham's worst case for the roundings on each path, scaled by the |.| replay"


def naive_pairwise_interaction(features: torch.Tensor) -> torch.Tensor:
    """The textbook form of :func:`dense.pairwise_interaction` (full ``bmm`` plus
    advanced indexing, autograd's backward): the reference the fast one must equal."""
    n = features.shape[1]
    z = torch.bmm(features, features.transpose(1, 2))  # [B, N, N]
    rows, cols = torch.tril_indices(n, n, offset=-1, device=features.device)
    return z[:, rows, cols]  # [B, N(N-1)/2]


def _config(**kw: object) -> DLRMConfig:
    base: dict[str, object] = dict(
        num_dense=5, num_sparse=3, embedding_dim=4, bottom_mlp=[8, 4], top_mlp=[6, 1]
    )
    base.update(kw)
    return DLRMConfig(**base)  # type: ignore[arg-type]


# Bounds for two float64 evaluations of the same function in other orders (a bmm against
# explicit loops, padded against unpadded layers): the functions here are sums and products
# (and ReLUs), so each evaluation is the exact function with every term perturbed by at most
# ``gamma_k``, ``k`` the roundings on the term's path (Higham, Lemma 3.1 and 3.3), and its
# error is at most ``gamma_k`` times the function evaluated on absolute values (the "|.|
# replay": |weights|, |inputs|, no ReLU, where nothing cancels). A ReLU is 1-Lipschitz and
# exact, so it passes an error on and adds none; in a gradient its mask is the same on both
# sides unless a pre-activation lies within ~1e-13 of zero (a chance of that order per unit
# for these inputs of order one).


def _abs_model(model: DLRMDense) -> DLRMDense:
    """A copy of ``model`` with every parameter replaced by its absolute value, each a
    leaf whose gradient the |.| replay fills."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.abs_()
    out.zero_grad(set_to_none=True)
    return out


def _linears(model: DLRMDense) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def _depths(model: DLRMDense, batch: int) -> tuple[int, int]:
    """``(forward, gradient)``: upper bounds on the roundings on any term's path. A dot
    product of ``n`` terms rounds each at most ``n`` times (its product and its share of
    the additions), a bias once more; the interaction's dots have ``D`` terms. A gradient
    is a product of forward quantities (the saved activations, the upstream ``2 out``) and
    sums back through every layer (``fan-out + 1``), the interaction's backward (one term
    per feature, plus the first vector's own gradient) and, for a weight, the batch."""
    cfg = model.config
    lin = _linears(model)
    forward = sum(m.in_features + 1 for m in lin) + cfg.embedding_dim
    backward = sum(m.out_features + 1 for m in lin) + cfg.num_sparse + 2
    return forward, 2 * forward + backward + batch + 1


def test_pairwise_interaction_matches_double_loop() -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3, 5, 4, generator=g, dtype=torch.float64)  # [B, N, D]
    got = pairwise_interaction(t)
    assert got.shape == (3, 10)
    # Each entry: one dot product of D = 4 terms, in two orders.
    tol = sum_tol(F64, 4, float(pairwise_interaction(t.abs()).max()))
    for b in range(3):
        want = []
        for i in range(5):
            for j in range(i):  # strictly lower triangle, row-major
                want.append(float(sum(t[b, i, k] * t[b, j, k] for k in range(4))))
        assert_close(got[b], torch.tensor(want, dtype=F64), atol=tol, what=f"sample {b}",
                     why="one dot product of 4 terms in two orders")  # fmt: skip


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
    assert_same(
        out_list, out_stacked, what="list vs stacked embeddings",
        why="the same interaction (the C kernel, built without FMA contraction, reading the "
        "same rows in the same order; or torch's bmm on a contiguous [B, N, D] copy) and "
        "the same MLP calls on tensors of the same shape, freshly allocated",
    )  # fmt: skip


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
def test_embeddings_given_as_a_function_equal_the_list(interaction: str) -> None:
    """``sparse`` as a function (called after the bottom MLP) gives the same logits
    and gradients as the list: the same operations on the same values, only created
    in another order."""
    torch.manual_seed(3)
    model = DLRMDense(_config(interaction=interaction))
    dense = torch.randn(6, 5)
    leaves = [torch.randn(6, 4) for _ in range(3)]

    def run(lazy: bool) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        emb = [t.clone().requires_grad_(True) for t in leaves]
        out = model(dense, (lambda: emb) if lazy else emb)
        out.sum().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return out.detach(), [e.grad for e in emb if e.grad is not None], grads

    eager, lazy = run(False), run(True)
    why = "the same operations on the same tensors; only their creation order differs"
    assert_same(lazy[0], eager[0], what="logits", why=why)
    for a, b in zip(lazy[1] + lazy[2], eager[1] + eager[2], strict=True):
        assert_same(a, b, what="gradients", why=why)


def test_embeddings_called_after_the_bottom_mlp_run_their_backward_before_it() -> None:
    """The order that lets a sparse step overlap the bottom MLP's backward: the
    embeddings' backward node runs before any bottom gradient is accumulated, and
    after every top gradient."""
    torch.manual_seed(4)
    model = DLRMDense(_config())
    order: list[str] = []
    for name, p in model.named_parameters():
        part = name.split(".")[0]  # "bottom" or "top"
        p.register_post_accumulate_grad_hook(lambda _, part=part: order.append(part))
    table = torch.randn(10, 4, requires_grad=True)
    called: list[bool] = []

    def pooled() -> list[torch.Tensor]:
        called.append(True)
        rows = table[torch.tensor([1, 2, 3, 4, 5, 6])]  # [6, 4]
        rows.register_hook(lambda g: order.append("embeddings") or g)
        return [rows, rows * 2, rows * 3]

    model(torch.randn(6, 5), pooled).sum().backward()
    assert called == [True]
    first_bottom = order.index("bottom")
    assert order.index("embeddings") < first_bottom, order
    assert "top" not in order[first_bottom:], order


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
    ref = _abs_model(model)
    mag = _naive_dense_forward(ref, dense.abs(), sparse.abs(), relu=False)
    tol = sum_tol(F64, _depths(model, 4)[0], float(mag.detach().max()))
    assert_close(model(dense, sparse), want, atol=tol, what="forward", why=BOUND)


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
    assert_same(fast, naive, what="pairs", why="the same bmm on equal tensors, the same entries")
    (fast * upstream).sum().backward()
    (naive * upstream).sum().backward()
    assert fast_in.grad is not None and naive_in.grad is not None
    # dT_i = sum_j G_ij T_j: one bmm over N terms (fast) or two of N terms added (naive),
    # at most N + 1 roundings per term; the |.| replay bounds the terms.
    abs_in = t.abs().requires_grad_(True)
    (naive_pairwise_interaction(abs_in) * upstream.abs()).sum().backward()
    assert abs_in.grad is not None
    tol = sum_tol(F64, n + 1, float(abs_in.grad.detach().max()))
    assert_close(fast_in.grad, naive_in.grad, atol=tol, what="input gradient", why=BOUND)


def _naive_dense_forward(
    model: DLRMDense,
    dense: torch.Tensor,
    sparse: torch.Tensor,
    relu: bool = True,
    masks: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """DLRMDense's forward from plain nn.Linear layers: no padding, no custom autograd
    (``relu=False``: without the ReLUs, for the |.| replay; ``masks``: each ReLU replaced
    by the product with the next of these 0/1 masks, the branches another run took)."""
    todo = iter(masks or [])

    def run(seq: torch.nn.Sequential, x: torch.Tensor) -> torch.Tensor:
        for layer in seq:
            if isinstance(layer, torch.nn.Linear):
                x = torch.nn.functional.linear(x, layer.weight, layer.bias)
            elif masks is not None:
                x = x * next(todo).to(x.dtype)
            elif relu:
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
    ref = _abs_model(model)
    abs_sp = sparse.abs().requires_grad_(True)
    mag = _naive_dense_forward(ref, dense.abs(), abs_sp, relu=False)
    mag.pow(2).sum().backward()  # the gradients' |.| replay, upstream 2 |out|
    fwd_depth, grad_depth = _depths(model, 5)
    tol = sum_tol(F64, fwd_depth, float(mag.detach().max()))
    assert_close(fast.detach(), naive.detach(), atol=tol, what="logits", why=BOUND)
    assert len(fast_grads) == len(naive_grads) == len(list(model.parameters()))
    for (name, p), a, b in zip(ref.named_parameters(), fast_grads, naive_grads, strict=True):
        assert a.shape == b.shape and p.grad is not None
        tol = sum_tol(F64, grad_depth, float(p.grad.detach().max()))
        assert_close(a, b, atol=tol, what=f"gradient of {name}", why=BOUND)
    assert fast_sp.grad is not None and abs_sp.grad is not None
    tol = sum_tol(F64, grad_depth, float(abs_sp.grad.detach().max()))
    assert_close(fast_sp.grad, naive_sp.grad, atol=tol, what="embedding gradient", why=BOUND)


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
    # The inputs are exact in float64, so the reference is the exact result to float64's
    # rounding; the kernel's pair is a dot of d terms (at most d roundings each), its first
    # vector and padding are copies. The |.| replay of the reference bounds the terms.
    abs_in = t.double().abs().requires_grad_(True)
    mag = _interact(abs_in, with_first=with_first, width=width)
    tol = sum_tol(torch.float32, d, float(mag.detach().max()))
    assert_close(fast.detach(), ref.detach(), atol=tol, what="forward", why=BOUND)
    assert bool((fast[:, width - 5 :] == 0).all())
    (fast * upstream).sum().backward()
    (ref * upstream.double()).sum().backward()
    (mag * upstream.double().abs()).sum().backward()
    assert fast_in.grad is not None and ref_in.grad is not None and abs_in.grad is not None
    # dT_i: a sum over the n - 1 other features, plus the first vector's own gradient.
    tol = sum_tol(torch.float32, n, float(abs_in.grad.detach().max()))
    assert_close(fast_in.grad, ref_in.grad, atol=tol, what="backward", why=BOUND)


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
    sp32, sp64 = sparse.clone().requires_grad_(True), sparse.double()
    masks: list[torch.Tensor] = []  # the float32 model's ReLU branches, in order
    for m in model.modules():
        if isinstance(m, torch.nn.ReLU):
            m.register_forward_hook(lambda _m, _i, out: masks.append(out.detach() > 0))
    out32 = model(dense, list(sp32.unbind(1)) if as_list else sp32)
    out64 = ref(dense.double(), sp64)
    # The float64 model computes the exact function of the same (exactly converted) inputs
    # and weights to float64's rounding: the float32 one is within gamma_k(float32) of the
    # |.| replay, the float64 one within gamma_k(float64).
    absm = _abs_model(ref)
    abs_sp = sp64.detach().abs().requires_grad_(True)
    mag = _naive_dense_forward(absm, dense.double().abs(), abs_sp, relu=False)
    fwd_depth, grad_depth = _depths(model, 80)

    def bound(k: int, magnitude: torch.Tensor) -> float:
        return (gamma(k, torch.float32) + gamma(k, F64)) * float(magnitude.detach().max())

    assert_close(
        out32.detach(), out64.detach(), atol=bound(fwd_depth, mag), what="logits", why=BOUND
    )
    out32.sum().backward()
    mag.sum().backward()
    assert sp32.grad is not None and abs_sp.grad is not None
    tol = bound(grad_depth, abs_sp.grad)
    # Where a pre-activation lies within rounding of zero the two models may take other
    # ReLU branches, and their gradients differ by more than rounding; the float64
    # gradient with the float32 model's branches is the exact one of the same branches.
    assert len(masks) == sum(isinstance(m, torch.nn.ReLU) for m in model.modules())
    sp_b = sp64.detach().clone().requires_grad_(True)
    _naive_dense_forward(ref, dense.double(), sp_b, masks=masks).sum().backward()
    assert sp_b.grad is not None
    assert_close(sp32.grad, sp_b.grad, atol=tol, what="embedding gradient", why=BOUND)
