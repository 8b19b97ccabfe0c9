"""DCN-v2's low-rank cross network (dense.dcn) against a plain-torch reference of the
formula, the DLRM with ``interaction="dcn"`` against its manual composition, and the
job's ``--interaction dcn`` end to end (train, resume naming a changed interaction)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
from torch import nn

import comm
from dense import CrossNetwork, DLRMConfig, DLRMDense
from hybridrec.dlrm.job import DLRMJobConfig, parse_args, train
from tolerance import assert_close, sum_tol

pytestmark = pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY

F64 = torch.float64
BOUND = "Higham's worst case for the roundings on each path, scaled by the |.| replay"


def reference_cross(x0: torch.Tensor, weights: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    """``x_{l+1} = x0 * (U_l (V_l^T x_l) + b_l) + x_l`` written out per sample: for each
    layer ``(U [W, r], V [W, r], b [W])``; ``x0 [B, W]``."""
    rows = []
    for i in range(x0.shape[0]):
        first = x0[i]  # [W]
        x = first
        for u, v, b in weights:
            low = v.t().mv(x)  # V^T x: [r]
            x = first * (u.mv(low) + b) + x  # [W]
        rows.append(x)
    return torch.stack(rows)  # [B, W]


def layer_weights(net: CrossNetwork) -> list[tuple[torch.Tensor, ...]]:
    """``(U, V, b)`` of each layer: ``up.weight`` is ``U``; ``down.weight`` is ``V^T``."""
    return [(lay.up.weight, lay.down.weight.t(), lay.up.bias) for lay in net.cross_layers]


# How far two float64 evaluations of the cross network (in other orders: a per-sample
# ``mv`` against batched matmuls) may be apart. The network is a polynomial in its inputs
# built from sums and products only, so each evaluation is the exact polynomial with every
# monomial perturbed by at most ``gamma_k``, ``k`` the roundings on its path (Higham,
# Lemma 3.1 and 3.3), and its error is at most ``gamma_k`` times the same polynomial
# evaluated on the absolute values (the "|.| replay", where nothing cancels). A layer
# rounds each path at most ``W`` times in ``V^T x`` (a product and its share of the
# additions), ``r + 1`` in ``U (.) + b``, then once in ``x0 * (.)`` and once in ``+ x``.
def cross_depth(width: int, layers: int, rank: int) -> int:
    """Roundings on any path through the forward of ``layers`` cross layers."""
    return layers * (width + rank + 3)


def abs_leaves(
    x0: torch.Tensor, weights: list[tuple[torch.Tensor, ...]]
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
    """``|x0|`` and ``|U|, |V|, |b|`` as fresh leaves: the inputs of the |.| replay."""
    leaf = lambda t: t.detach().abs().clone().requires_grad_(True)  # noqa: E731
    return leaf(x0), [tuple(leaf(t) for t in w) for w in weights]


@pytest.mark.parametrize(
    ("batch", "width", "layers", "rank"), [(5, 12, 1, 3), (7, 20, 3, 4), (3, 9, 2, 9), (4, 6, 4, 1)]
)
def test_cross_network_equals_reference_forward_and_gradients(
    batch: int, width: int, layers: int, rank: int
) -> None:
    torch.manual_seed(batch * 100 + width)
    net = CrossNetwork(width, layers, rank).double()
    with torch.no_grad():  # a nonzero bias too (the init's is zero)
        for lay in net.cross_layers:
            lay.up.bias.normal_()
    x0 = torch.randn(batch, width, dtype=torch.float64, requires_grad=True)
    out = net(x0)
    assert out.shape == (batch, width)

    # The reference on detached copies of the same numbers, as leaves of its own graph.
    ref_x0 = x0.detach().clone().requires_grad_(True)
    ref_w = [tuple(t.detach().clone().requires_grad_(True) for t in w) for w in layer_weights(net)]
    want = reference_cross(ref_x0, ref_w)
    abs_x0, abs_w = abs_leaves(x0, layer_weights(net))
    abs_out = reference_cross(abs_x0, abs_w)  # the |.| replay: bounds every path's terms
    depth = cross_depth(width, layers, rank)
    tol = sum_tol(F64, depth, float(abs_out.detach().max()))
    assert_close(out.detach(), want.detach(), atol=tol, what="cross network output", why=BOUND)

    grad_out = torch.randn(batch, width, dtype=torch.float64)
    out.backward(grad_out)
    want.backward(grad_out)
    abs_out.backward(grad_out.abs())  # the gradients' |.| replay
    assert x0.grad is not None and ref_x0.grad is not None and abs_x0.grad is not None
    # A gradient's path: the forward to the parameter's layer, back through every layer
    # (the same roundings again), the product with ``grad_out`` and the sum over the batch.
    grad_depth = 2 * depth + 1 + batch

    def check(got: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor | None, what: str) -> None:
        assert mag is not None
        tol = sum_tol(F64, grad_depth, float(mag.detach().max()))
        assert_close(got, ref, atol=tol, what=f"gradient of {what}", why=BOUND)

    check(x0.grad, ref_x0.grad, abs_x0.grad, "x0")
    for i, (lay, (u, v, b), (au, av, ab)) in enumerate(
        zip(net.cross_layers, ref_w, abs_w, strict=True)
    ):
        assert u.grad is not None and v.grad is not None and b.grad is not None
        assert av.grad is not None
        check(lay.up.weight.grad, u.grad, au.grad, f"layer {i} U")
        check(lay.down.weight.grad, v.grad.t(), av.grad.t(), f"layer {i} V")
        check(lay.up.bias.grad, b.grad, ab.grad, f"layer {i} b")


def test_fresh_layers_start_near_the_identity_and_params_are_low_rank() -> None:
    net = CrossNetwork(32, 2, 4)
    # 2 W r weights and W biases per layer instead of the full-rank W^2 + W.
    assert sum(p.numel() for p in net.parameters()) == 2 * (2 * 32 * 4 + 32)
    x0 = torch.randn(8, 32)
    assert net(x0).shape == (8, 32)
    with pytest.raises(ValueError, match=r"input must be \[B, 32\], got shape \(8, 31\)"):
        net(torch.randn(8, 31))
    with pytest.raises(ValueError, match="rank must be an int >= 1, got 0"):
        CrossNetwork(32, 2, 0)


@pytest.mark.parametrize("as_list", [True, False])
def test_dlrm_with_dcn_equals_its_manual_composition(as_list: bool) -> None:
    torch.manual_seed(3)
    cfg = DLRMConfig(num_dense=5, num_sparse=3, embedding_dim=4, bottom_mlp=[8, 4],
                     top_mlp=[6, 1], interaction="dcn", dcn_layers=2, dcn_rank=3)  # fmt: skip
    assert cfg.top_input_dim == (3 + 1) * 4
    model = DLRMDense(cfg).double()
    dense = torch.randn(6, 5, dtype=torch.float64)
    sparse = [torch.randn(6, 4, dtype=torch.float64) for _ in range(3)]
    got = model(dense, sparse if as_list else torch.stack(sparse, dim=1))

    x = model.bottom(dense)  # [B, D]
    x0 = torch.cat([x, *sparse], dim=1)  # [B, (F+1)D]
    assert model.cross is not None
    crossed = reference_cross(x0, layer_weights(model.cross))
    top, out = cast(nn.Linear, model.top[0]), cast(nn.Linear, model.top[2])  # AlignedLinear
    h = torch.relu(crossed @ top.weight.t() + top.bias)
    want = (h @ out.weight.t() + out.bias).squeeze(1)
    # Both sides compute the bottom MLP alike (the same call); the cross network and the
    # top MLP in other orders. Their |.| replay (the ReLU, 1-Lipschitz and exact, dropped)
    # bounds the terms; the top layers add ``fan-in + 1`` roundings each to every path.
    abs_x0, abs_w = abs_leaves(x0, layer_weights(model.cross))
    abs_h = reference_cross(abs_x0, abs_w) @ top.weight.t().abs() + top.bias.abs()
    abs_out = abs_h @ out.weight.t().abs() + out.bias.abs()
    width = x0.shape[1]
    depth = cross_depth(width, 2, 3) + (width + 1) + (top.out_features + 1)
    tol = sum_tol(F64, depth, float(abs_out.detach().max()))
    assert_close(
        got.detach(), want.detach(), atol=tol, what="DLRM with DCN vs its composition", why=BOUND
    )

    got.sum().backward()  # every part learns, the cross layers included
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"interaction": "cross"}, r"interaction must be one of \('dot', 'dcn'\), got 'cross'"),
        ({"interaction": "dcn", "dcn_layers": 0}, r"dcn_layers must be an int >= 1, got 0"),
        ({"interaction": "dcn", "dcn_rank": -2}, r"dcn_rank must be an int >= 1, got -2"),
    ],
)
def test_dlrm_config_validates_the_interaction(kw: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        DLRMConfig(num_dense=2, num_sparse=2, embedding_dim=4, bottom_mlp=[4], **kw)  # type: ignore[arg-type]


def test_job_options_and_their_errors() -> None:
    cfg = parse_args(["--interaction", "dcn", "--dcn-layers", "2", "--dcn-rank", "8"])
    assert (cfg.interaction, cfg.dcn_layers, cfg.dcn_rank) == ("dcn", 2, 8)
    # MovieLens's defaults (chosen by validation AUC) use DCN-v2; other data the dot.
    movielens, synthetic = parse_args([]), parse_args(["--data", "synthetic"])
    assert (movielens.interaction, movielens.dim, movielens.top_mlp) == ("dcn", 32, [128, 64, 1])
    assert (synthetic.interaction, synthetic.dim, synthetic.top_mlp) == ("dot", 16, [64, 32, 1])
    assert (movielens.epochs, movielens.patience, synthetic.epochs, synthetic.patience) == (
        8,
        2,
        1,
        0,
    )
    assert parse_args(["--no-keep-best"]).patience == 0
    with pytest.raises(ValueError, match="dcn_rank must be >= 1, got 0"):
        DLRMJobConfig(interaction="dcn", dcn_rank=0)
    with pytest.raises(ValueError, match="interaction must be 'dot' or 'dcn', got 'mlp'"):
        DLRMJobConfig(interaction="mlp")  # type: ignore[arg-type]


SMALL: dict[str, Any] = dict(
             data="synthetic", synthetic_samples=4_000, synthetic_rows=200, batch_size=64,
             dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1], lr=0.01, emb_lr=0.1, verbose=False,
             progress=False)  # fmt: skip


@pytest.mark.timeout(120)
def test_dcn_job_trains_and_a_resume_names_the_changed_interaction(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    cfg = DLRMJobConfig(**SMALL, interaction="dcn", dcn_layers=2, dcn_rank=4, max_steps=40,
                      checkpoint_dir=ckpt)  # fmt: skip
    metrics = train(cfg, comm.LocalGroup())
    assert metrics["steps"] == 40
    assert metrics["test_auc"] > 0.55, metrics["test_auc"]  # learned something
    losses = [r["train_loss"] for r in metrics["epochs"]]
    assert all(loss == loss for loss in losses), losses  # finite
    resumed = DLRMJobConfig(**SMALL, interaction="dot", max_steps=60, checkpoint_dir=ckpt,
                          resume=True)  # fmt: skip
    with pytest.raises(ValueError, match="interaction: 'dcn' in the checkpoint, 'dot' now"):
        train(resumed, comm.LocalGroup())
