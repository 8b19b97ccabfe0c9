"""dense.sasrec and dense.hstu: shapes, empty batches, causality, padding that does not leak,
SASRec against torch's TransformerEncoderLayer, HSTU against explicit loops, the time bias,
a tiny next-item task, config and input errors."""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dense.hstu import HSTU, HSTUConfig, HSTULayer
from dense.sasrec import SASRec, SASRecBlock, SASRecConfig
from tolerance import assert_close, assert_same, max_abs_diff, replay_tol

pytestmark = pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY

D = 16
SAS: dict[str, Any] = dict(dim=D, max_seq_len=12, n_layer=2, n_head=2, inner_dim=32)
HST: dict[str, Any] = dict(dim=D, max_seq_len=12, n_layer=2, n_head=2, time_buckets=128)
Model = SASRec | HSTU


def make_sasrec(**kw: Any) -> SASRec:
    return SASRec(SASRecConfig(**{**SAS, **kw}))


def make_hstu(**kw: Any) -> HSTU:
    return HSTU(HSTUConfig(**{**HST, **kw}))


MAKERS: dict[str, Callable[..., Model]] = {"sasrec": make_sasrec, "hstu": make_hstu}
both = pytest.mark.parametrize("name", sorted(MAKERS))


def jagged(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``item_vecs [N, D]``, ``offsets [B + 1]`` and increasing ``times [N]`` (seconds)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    vecs = torch.randn(n, D, generator=g)
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int64)
    times = 1_700_000_000 + torch.randint(1, 100_000, (n,), generator=g).cumsum(0)
    return vecs, offsets, times


# ---------------------------------------------------------------- shapes, empty batches


def test_parameter_counts() -> None:
    d, t, n, i = D, 12, 2, 32
    per_block = (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * i + i) + (i * d + d) + 2 * d
    assert make_sasrec().num_parameters() == t * d + 2 * d + n * per_block
    h, dh, buckets = 2, d // 2, 128
    per_layer = d * h * 4 * dh + (t + buckets) + (h * dh * d + d)
    assert make_hstu().num_parameters() == t * d + n * per_layer
    assert make_hstu(time_buckets=0, position_bias=False).num_parameters() == t * d + n * (
        per_layer - t - buckets
    )


@both
def test_shapes_and_a_batch_with_an_empty_sequence(name: str) -> None:
    torch.manual_seed(0)
    model = MAKERS[name]()  # training mode: dropout on
    vecs, offsets, times = jagged([3, 0, 5, 1], seed=1)
    out = model(vecs.requires_grad_(), offsets, times)
    assert out.shape == (9, D) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    assert vecs.grad is not None and torch.isfinite(vecs.grad).all()


@both
@pytest.mark.parametrize("offsets", [[0], [0, 0], [0, 0, 0]], ids=["B0", "B1-empty", "B2-empty"])
def test_empty_batch_keeps_every_parameter_in_the_graph(name: str, offsets: list[int]) -> None:
    torch.manual_seed(0)
    model = MAKERS[name]()
    vecs = torch.zeros(0, D, requires_grad=True)
    out = model(vecs, torch.tensor(offsets), torch.zeros(0, dtype=torch.int64))
    assert out.shape == (0, D)
    out.sum().backward()  # what DataParallel needs: a (zero) gradient for every parameter
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)), pname


# ---------------------------------------------------------------- causality, padding


@both
@pytest.mark.parametrize("positions", ["first", "last"])
def test_the_future_does_not_change_the_past(name: str, positions: str) -> None:
    torch.manual_seed(2)
    model = MAKERS[name](positions=positions).eval()
    vecs, offsets, times = jagged([8, 5], seed=3)
    base = model(vecs, offsets, times)
    for t in (0, 3, 6):
        for what in ("items", "times"):
            v2, t2 = vecs.clone(), times.clone()
            if what == "items":
                v2[t + 1 : 8] = torch.randn(7 - t, D)  # every later item of sequence 0
            else:
                t2[t + 1 : 8] += 10_000_000  # every later time of sequence 0
            out = model(v2, offsets, t2)
            # Masked entries are exact zeros (a softmax weight of 0, or HSTU's 0 by
            # torch.where) and the shapes and kernels are the same: same bits.
            why = "the future is masked to exact zeros"
            assert_same(out[: t + 1], base[: t + 1], what=f"{name} rows <= {t}", why=why)
            assert_same(out[8:], base[8:], what=f"{name} other sequence", why=why)
            if what == "items" or name == "hstu":
                assert max_abs_diff(out[t + 1 : 8], base[t + 1 : 8]) > 1e-4  # the future moved


@both
@pytest.mark.parametrize("positions", ["first", "last"])
@torch.no_grad()
def test_padding_does_not_leak_into_a_shorter_sequence(name: str, positions: str) -> None:
    torch.manual_seed(4)
    model = MAKERS[name](positions=positions).eval()
    va, oa, ta = jagged([5], seed=5)  # sequence A alone
    vb, _, tb = jagged([11], seed=6)  # a longer one, B
    alone = model(va, oa, ta)
    # The same computation in float64: how far fp32 rounding moves A's outputs.
    alone64 = copy.deepcopy(model).double()(va.double(), oa, ta)
    tol = replay_tol(alone, alone64)
    why = "a few times A's measured fp32 rounding (other shapes, other kernels)"
    offsets = torch.tensor([0, 11, 16])
    after = model(torch.cat([vb, va]), offsets, torch.cat([tb, ta]))[11:]
    assert_close(after, alone, atol=tol, what=f"{name}: A after B", why=why)
    offsets = torch.tensor([0, 5, 16])
    before = model(torch.cat([va, vb]), offsets, torch.cat([ta, tb]))[:5]
    assert_close(before, alone, atol=tol, what=f"{name}: A before B", why=why)


# ---------------------------------------------------------------- independent references


def _sasrec_reference(model: SASRec) -> nn.ModuleList:
    """torch's post-LN TransformerEncoderLayers with the weights of ``model``'s blocks."""
    cfg = model.cfg
    layers = nn.ModuleList()
    for block in model.blocks:
        assert isinstance(block, SASRecBlock)
        ref = nn.TransformerEncoderLayer(
            cfg.dim, cfg.n_head, dim_feedforward=cfg.inner_dim, dropout=0.0, activation="gelu",
            layer_norm_eps=cfg.layer_norm_eps, batch_first=True, norm_first=False,
        )  # fmt: skip
        with torch.no_grad():
            ref.self_attn.in_proj_weight.copy_(block.attn.qkv.weight)  # [q; k; v] rows
            ref.self_attn.in_proj_bias.copy_(block.attn.qkv.bias)
            pairs: list[tuple[nn.Linear | nn.LayerNorm, nn.Linear | nn.LayerNorm]] = [
                (ref.self_attn.out_proj, block.attn.proj), (ref.norm1, block.attn.ln),
                (ref.linear1, block.ff.fc), (ref.linear2, block.ff.proj), (ref.norm2, block.ff.ln),
            ]  # fmt: skip
            for dst, src in pairs:
                dst.weight.copy_(src.weight)
                dst.bias.copy_(src.bias)
        layers.append(ref)
    return layers.eval()


@pytest.mark.parametrize("positions", ["first", "last"])
def test_sasrec_matches_torch_transformer_encoder_layers(positions: str) -> None:
    torch.manual_seed(7)
    model = make_sasrec(positions=positions).eval()
    m = model.cfg.max_seq_len
    lengths = [7, 3, 5]
    vecs, offsets, _ = jagged(lengths, seed=8)
    ref_layers = _sasrec_reference(model)

    def reference(dtype: torch.dtype) -> torch.Tensor:
        """Each sequence alone (no padding), its positions as the layout says: from 0
        for "first", ending at max_seq_len - 1 for "last" (the paper's code left-pads
        to max_seq_len and masks the padding keys, which is the same)."""
        layers = copy.deepcopy(ref_layers).to(dtype)
        outs = []
        for lo, n in zip(offsets[:-1].tolist(), lengths, strict=True):
            first = 0 if positions == "first" else m - n
            x = vecs[lo : lo + n].to(dtype)[None] + model.pos_emb.weight[first : first + n].to(
                dtype
            )  # [1, n, D]
            x = F.layer_norm(x, (D,), model.ln.weight.to(dtype), model.ln.bias.to(dtype), 1e-12)
            future = torch.ones(n, n, dtype=torch.bool).triu(1)  # True: may NOT attend
            for layer in layers:
                x = layer(x, src_mask=future)
            outs.append(x[0])
        return torch.cat(outs)  # [N, D]

    with torch.no_grad():
        ref, ref64 = reference(torch.float32), reference(torch.float64)
        out = model(vecs, offsets)
    tol = replay_tol(ref, ref64)
    why = "a few times the reference's measured fp32 rounding"
    assert_close(
        out, ref, atol=tol, what=f"SASRec ({positions}) vs TransformerEncoderLayer", why=why
    )
    if positions == "last":  # the newest items share a position, whatever the lengths
        first = make_sasrec().eval()
        first.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert max_abs_diff(first(vecs, offsets), out) > 1e-3


def _hstu_loops(model: HSTU, vecs: torch.Tensor, times: list[int]) -> torch.Tensor:
    """One sequence through ``model`` by explicit loops over positions, heads and keys,
    in float64 Python arithmetic on the model's weights (absolute positions from 0, or
    ending at ``max_seq_len - 1`` with ``positions="last"``)."""
    cfg = model.cfg
    h, dqk, dv, big_t = cfg.n_head, cfg.qk_dim, cfg.v_dim, cfg.max_seq_len
    w = {k: v.detach().double() for k, v in model.state_dict().items()}

    def layer_norm(z: torch.Tensor) -> torch.Tensor:  # no learned scale or bias
        mean = sum(z.tolist()) / len(z)
        var = sum((c - mean) ** 2 for c in z.tolist()) / len(z)
        return (z - mean) / math.sqrt(var + cfg.layer_norm_eps)

    def silu(s: float) -> float:
        return s / (1.0 + math.exp(-s))

    n = vecs.shape[0]
    first = 0 if cfg.positions == "first" else big_t - n
    xs = [vecs[i].double() * math.sqrt(cfg.dim) + w["pos_emb.weight"][first + i] for i in range(n)]
    for li in range(cfg.n_layer):
        p = f"layers.{li}."
        pre = [(w[p + "f1.weight"] @ layer_norm(x)).tolist() for x in xs]
        uvqk = [torch.tensor([silu(c) for c in z], dtype=torch.float64) for z in pre]
        us = [z[: h * dv] for z in uvqk]
        vs = [z[h * dv : 2 * h * dv] for z in uvqk]
        qs = [z[2 * h * dv : 2 * h * dv + h * dqk] for z in uvqk]
        ks = [z[2 * h * dv + h * dqk :] for z in uvqk]
        new = []
        for i in range(n):
            o = torch.zeros(h * dv, dtype=torch.float64)
            for hd in range(h):
                for j in range(i + 1):
                    s = float(qs[i][hd * dqk : (hd + 1) * dqk] @ ks[j][hd * dqk : (hd + 1) * dqk])
                    s += float(w[p + "rab.pos_w"][min(i - j, big_t - 1)])
                    gap = max(abs(times[i] - times[j]), 1)
                    bucket = min(max(math.floor(math.log(gap) / 0.301), 0), cfg.time_buckets - 1)
                    s += float(w[p + "rab.time_w"][bucket])
                    o[hd * dv : (hd + 1) * dv] += silu(s) / big_t * vs[j][hd * dv : (hd + 1) * dv]
            y = w[p + "f2.weight"] @ (layer_norm(o) * us[i]) + w[p + "f2.bias"]
            new.append(xs[i] + y)
        xs = new
    return torch.stack(xs)


@pytest.mark.parametrize("positions", ["first", "last"])
def test_hstu_matches_explicit_loops(positions: str) -> None:
    torch.manual_seed(9)
    model = make_hstu(dim=D, n_head=2, attn_dim=3, linear_dim=5, positions=positions).eval()
    for layer in model.layers:  # biases large enough to matter
        assert isinstance(layer, HSTULayer) and layer.rab.time_w is not None
        with torch.no_grad():
            layer.rab.time_w.normal_(std=1.0)
            assert layer.rab.pos_w is not None
            layer.rab.pos_w.normal_(std=1.0)
    times = [1_000, 1_007, 1_107, 4_107, 4_108]  # ln(gap) / 0.301 is far from an integer
    vecs = torch.randn(5, D)
    with torch.no_grad():
        out64 = copy.deepcopy(model).double()(
            vecs.double(), torch.tensor([0, 5]), torch.tensor(times)
        )
    ref = _hstu_loops(model, vecs, times)
    # Both in float64, the sums in other orders: ~1e-15 relative each, ~1e-13 after two
    # layers of O(10) values; a wrong formula is off by more than 1e-3.
    assert_close(out64, ref, atol=1e-9, what="HSTU vs loops", why="float64 rounding")


# ---------------------------------------------------------------- time bias


@both
def test_times_change_hstu_only(name: str) -> None:
    torch.manual_seed(10)
    model = MAKERS[name]().eval()
    if isinstance(model, HSTU):
        for layer in model.layers:
            assert isinstance(layer, HSTULayer) and layer.rab.time_w is not None
            with torch.no_grad():
                layer.rab.time_w.normal_(std=1.0)
    vecs, offsets, times = jagged([6, 4], seed=11)
    later = times.clone()
    later[1::2] += 3_000_000  # other gaps, other buckets
    a, b = model(vecs, offsets, times), model(vecs, offsets, later)
    if name == "sasrec":
        assert_same(a, b, what="SASRec", why="SASRec ignores times")
    else:
        assert max_abs_diff(a, b) > 1e-3
        no_time = make_hstu(time_buckets=0).eval()
        assert_same(no_time(vecs, offsets, times), no_time(vecs, offsets, later),
                    what="HSTU time_buckets=0", why="no time bias")  # fmt: skip
        assert no_time(vecs, offsets).shape == (10, D)  # times not needed


# ---------------------------------------------------------------- training


@both
def test_learns_next_item_is_item_plus_one(name: str) -> None:
    torch.manual_seed(12)
    v, steps = 20, 60  # both reach 100 % by about step 30 (seeds 1, 2, 12 tried)
    kw = dict(dropout=0.1) if name == "hstu" else dict(dropout=0.1, attn_dropout=0.1)
    model = MAKERS[name](**kw)
    table = nn.Embedding(v, D)  # the tied item table (stands in for the sparse collection)
    nn.init.normal_(table.weight, std=0.1)
    opt = torch.optim.Adam([*model.parameters(), *table.parameters()], lr=1e-2)
    g = torch.Generator().manual_seed(13)

    def batch(b: int) -> tuple[torch.Tensor, ...]:
        lengths = torch.randint(1, 11, (b,), generator=g)  # 1..10 inputs per sequence
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        first = torch.randint(0, v, (b,), generator=g).repeat_interleave(lengths)
        pos = torch.arange(int(offsets[-1])) - offsets[:-1].repeat_interleave(lengths)
        items = (first + pos) % v  # [N]: a run of consecutive items per sequence
        times = (pos * 60).long()
        return items, offsets, times, (items + 1) % v

    def accuracy() -> float:
        model.eval()
        with torch.no_grad():
            items, offsets, times, target = batch(64)
            h = model(table(items), offsets, times)
            return float(((h @ table.weight.T).argmax(1) == target).float().mean())

    for _ in range(steps):
        model.train()
        items, offsets, times, target = batch(16)
        h = model(table(items), offsets, times)  # [N, D]
        loss = F.cross_entropy(h @ table.weight.T, target)  # tied table: [N, V] logits
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert accuracy() > 0.9


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (SASRecConfig, dict(dim=30, n_head=4), "dim 30 must be a multiple of n_head 4"),
        (SASRecConfig, dict(n_layer=0), "n_layer must be an int > 0, got 0"),
        (SASRecConfig, dict(max_seq_len=2.5), "max_seq_len must be an int > 0, got 2.5"),
        (SASRecConfig, dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
        (SASRecConfig, dict(attn_dropout=-0.1), r"attn_dropout must be in \[0, 1\), got -0.1"),
        (SASRecConfig, dict(layer_norm_eps=0.0), "layer_norm_eps must be > 0, got 0.0"),
        (SASRecConfig, dict(act="swish"), "act must be one of .*, got 'swish'"),
        (SASRecConfig, dict(positions="end"), "positions must be one of .*, got 'end'"),
        (HSTUConfig, dict(positions="newest"), "positions must be one of .*, got 'newest'"),
        (HSTUConfig, dict(dim=30, n_head=4), "dim 30 must be a multiple of n_head 4 when attn_dim"),
        (HSTUConfig, dict(attn_dim=0), "attn_dim must be None or an int > 0, got 0"),
        (HSTUConfig, dict(linear_dim=-2), "linear_dim must be None or an int > 0, got -2"),
        (HSTUConfig, dict(time_buckets=-1), "time_buckets must be an int >= 0, got -1"),
        (HSTUConfig, dict(dropout=1.5), r"dropout must be in \[0, 1\), got 1.5"),
        (HSTUConfig, dict(n_head=True), "n_head must be an int > 0, got True"),
    ],
)
def test_bad_config(cls: type, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_hstu_config_dims() -> None:
    cfg = HSTUConfig(dim=30, n_head=4, attn_dim=8, linear_dim=6)  # no multiple needed
    assert (cfg.qk_dim, cfg.v_dim) == (8, 6)
    assert (HSTUConfig(dim=64, n_head=4).qk_dim, HSTUConfig(dim=64, n_head=4).v_dim) == (16, 16)
    with pytest.raises(TypeError, match="position_bias must be a bool"):
        HSTUConfig(position_bias=1)  # type: ignore[arg-type]


@both
def test_bad_inputs(name: str) -> None:
    model = MAKERS[name]()
    vecs, offsets, times = jagged([3, 2], seed=14)
    with pytest.raises(ValueError, match=r"item_vecs must be \[N, dim=16\], got shape \(5, 8\)"):
        model(vecs[:, :8], offsets, times)
    with pytest.raises(ValueError, match=r"offsets must run from 0 to N=5 .*, got 0 \.\. 4"):
        model(vecs, torch.tensor([0, 2, 4]), times)
    with pytest.raises(ValueError, match="offsets must be non-decreasing, a length is -1"):
        model(vecs, torch.tensor([0, 3, 2, 5]), times)
    with pytest.raises(ValueError, match="a sequence has 13 items, more than max_seq_len=12"):
        v13, o13, t13 = jagged([13], seed=15)
        model(v13, o13, t13)
    with pytest.raises(TypeError, match="offsets must be int64, got torch.int32"):
        model(vecs, offsets.int(), times)
    with pytest.raises(TypeError, match="cfg must be"):
        type(model)(object())  # type: ignore[arg-type]


def test_hstu_needs_times() -> None:
    model = make_hstu()
    vecs, offsets, times = jagged([3, 2], seed=16)
    with pytest.raises(ValueError, match="HSTUConfig.time_buckets=128 needs times"):
        model(vecs, offsets)
    with pytest.raises(ValueError, match=r"times must be \[N=5\], got \(4,\)"):
        model(vecs, offsets, times[:4])
    with pytest.raises(TypeError, match="times must be int64 seconds, got torch.float32"):
        model(vecs, offsets, times.float())
