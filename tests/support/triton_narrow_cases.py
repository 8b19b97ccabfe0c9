"""Cases for the Triton kernels on fp16 and bf16 rows; run as a script (like triton_cases.py).

``python tests/support/triton_narrow_cases.py --device cpu`` runs every case in Triton's
interpreter (``TRITON_INTERPRET=1`` is set before the kernel modules are imported) and
prints one JSON line per case, ``{"case": name, "ok": bool, "error": str}``; ``--device
cuda`` runs them compiled on a GPU. ``tests/embedding/test_triton_narrow.py`` runs it.

The reference of a narrow kernel is the same kernel on the rows widened to float32 (a
narrow row widens exactly, and a load of a narrow row is widened before any arithmetic),
followed, for an update, by :func:`ps.rounding.round_to` of the touched rows with each
row's table seed, its id in the table and its clock after the update: so the narrow
results are compared bit for bit.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch

from tolerance import assert_same
from triton_cases import make_batch, optimizers, random_state, run_all

NARROW = {"fp16": torch.float16, "bf16": torch.bfloat16}
SAME_KERNEL = (
    "one kernel on rows that widen exactly: the float32 arithmetic is the same, and the "
    "narrow store rounds with round_to's bits"
)


def _keys(dtype: torch.dtype, sizes: list[int], seeds: list[int], device: str) -> object:
    from ps.kernels.narrow_rows import RoundingKeys

    return RoundingKeys.of_tables(dtype, sizes, seeds, device)


def _round_touched(
    wide: torch.Tensor,
    rows: torch.Tensor,
    clocks: torch.Tensor,
    sizes: list[int],
    seeds: list[int],
    dtype: torch.dtype,
    row_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 ``wide`` ``[R, D]`` with its ``rows`` rounded by ``round_to`` (per table)."""
    from ps.rounding import round_to

    out = wide.cpu().to(dtype)  # untouched rows are narrow values already: exact
    starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    rows = rows.cpu()
    for k, seed in enumerate(seeds):
        sel = rows[(rows >= starts[k]) & (rows < starts[k + 1])]
        if sel.numel() == 0:
            continue
        ids = sel - starts[k] if row_ids is None else row_ids.cpu()[sel]
        out[sel] = round_to(wide.cpu()[sel], dtype, seed=seed, ids=ids, versions=clocks.cpu()[sel])
    return out


def _check_pool(device: str, dtype: torch.dtype) -> None:
    from embedding.kernels.triton_pool import pooled_lookup

    b = make_batch(
        seed=3, table_rows=[30, 17], dim=13, batch=7, max_len=6, weighted=True, device=device
    )
    narrow = b.weight.to(dtype)
    for mode in ("sum", "mean"):
        for psw in (None, b.psw):
            got = pooled_lookup(narrow, b.ids, b.offsets, mode=mode, per_sample_weights=psw)
            want = pooled_lookup(
                narrow.float(), b.ids, b.offsets, mode=mode, per_sample_weights=psw
            )
            assert got.dtype == torch.float32, got.dtype
            assert_same(got.cpu(), want.cpu(), what=f"{dtype} pool ({mode})", why=SAME_KERNEL)


def case_pool_fp16(device: str) -> None:
    _check_pool(device, torch.float16)


def case_pool_bf16(device: str) -> None:
    _check_pool(device, torch.bfloat16)


def _check_update(
    device: str, name: str, dtype: torch.dtype, *, rows_form: bool, dim: int = 13
) -> None:
    """Two steps of the fused backward (or of ``apply_rows_``) on narrow rows of ``dim``
    columns against the float32 kernel on the widened rows, rounded."""
    from embedding.kernels.triton_optimizers import apply_rows_, fused_backward_

    opt = optimizers()[name]
    sizes, seeds = [20, 14], [11, 2**63 - 1]
    b = make_batch(
        seed=41, table_rows=sizes, dim=dim, batch=5, max_len=6, weighted=True, device=device, hot=4
    )
    rows, dim = b.weight.shape
    narrow = b.weight.to(dtype)  # the rows, rounded to the nearest once
    wide = narrow.float()
    s0 = random_state(opt, rows, dim, seed=5).to(device)
    s_n, s_w = s0.clone(), s0.clone()
    c_n = torch.zeros(rows, dtype=torch.int64, device=device)
    c_w = c_n.clone()
    row_ids = None
    if rows_form:  # a shard's rows: table ids given per row (a permutation here)
        row_ids = torch.randperm(rows, generator=torch.Generator().manual_seed(2)).to(device)
    keys = _keys(dtype, sizes, seeds, device)
    if row_ids is not None:
        from ps.kernels.narrow_rows import RoundingKeys

        assert isinstance(keys, RoundingKeys)
        keys = RoundingKeys(keys.dtype, keys.starts, keys.seeds, row_ids)
    g = torch.Generator().manual_seed(9)
    for _ in range(2):
        if rows_form:
            touched = torch.unique(b.ids)
            grads = torch.randn(touched.numel(), dim, generator=g).to(device)
            apply_rows_(narrow, s_n, touched, grads, opt, clocks=c_n, rounding=keys)  # type: ignore[arg-type]
            apply_rows_(wide, s_w, touched, grads, opt, clocks=c_w)  # type: ignore[arg-type]
        else:
            touched = torch.unique(b.ids)
            grad_out = torch.randn(b.offsets.numel() - 1, dim, generator=g).to(device)
            for w, s, c, k in ((narrow, s_n, c_n, keys), (wide, s_w, c_w, None)):
                fused_backward_(
                    w,
                    s,
                    b.ids,
                    b.offsets,
                    grad_out,
                    opt,  # type: ignore[arg-type]
                    mode="sum",
                    per_sample_weights=b.psw,
                    clocks=c,
                    rounding=k,  # type: ignore[arg-type]
                )
        wide = _round_touched(wide, touched, c_w, sizes, seeds, dtype, row_ids).float().to(device)
    assert narrow.dtype == dtype
    assert_same(narrow.cpu().float(), wide.cpu(), what=f"{name} {dtype} rows", why=SAME_KERNEL)
    assert_same(s_n.cpu(), s_w.cpu(), what=f"{name} state", why="float32 state, one kernel")
    assert torch.equal(c_n.cpu(), c_w.cpu())


def _update_case(name: str, dtype: str, rows_form: bool, dim: int = 13) -> Callable[[str], None]:
    def case(device: str) -> None:
        _check_update(device, name, NARROW[dtype], rows_form=rows_form, dim=dim)

    return case


def case_bad_input(device: str) -> None:
    from embedding.kernels.triton_optimizers import apply_rows_
    from ps.optimizers import SGD

    w = torch.zeros(4, 3, dtype=torch.float16, device=device)
    s = torch.zeros(4, 0, device=device)
    c = torch.zeros(4, dtype=torch.int64, device=device)
    rows = torch.tensor([1], device=device)
    g = torch.ones(1, 3, device=device)
    for call, match in (
        (lambda: apply_rows_(w, s, rows, g, SGD(lr=1.0), clocks=c), "pass its rounding keys"),
        (
            lambda: apply_rows_(
                w, s, rows, g, SGD(lr=1.0), rounding=_keys(torch.float16, [4], [1], device)
            ),  # type: ignore[arg-type]
            "and its clocks",
        ),
        (
            lambda: apply_rows_(
                w.float(),
                s,
                rows,
                g,
                SGD(lr=1.0),
                clocks=c,
                rounding=_keys(torch.float16, [4], [1], device),
            ),  # type: ignore[arg-type]
            "rounding keys are for fp16/bf16 rows",
        ),
        (
            lambda: apply_rows_(
                w,
                s,
                rows,
                g,
                SGD(lr=1.0),
                clocks=c,
                rounding=_keys(torch.bfloat16, [4], [1], device),
            ),  # type: ignore[arg-type]
            "rounding keys of torch.bfloat16",
        ),
    ):
        try:
            call()
        except ValueError as err:
            assert match in str(err), (match, str(err))
        else:
            raise AssertionError(f"no ValueError ({match})")
    assert bool((w == 0).all()), "a refused call wrote rows"


CASES: dict[str, Callable[[str], None]] = {
    name[len("case_") :]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")
}
for _opt in ("sgd", "sgd_momentum", "rowwise_adagrad", "adagrad", "adam", "ftrl"):
    for _dt in NARROW:
        CASES[f"update_{_opt}_{_dt}"] = _update_case(_opt, _dt, rows_form=False)
CASES["rows_adam_fp16_row_ids"] = _update_case("adam", "fp16", rows_form=True)
CASES["rows_rowwise_adagrad_bf16_row_ids"] = _update_case("rowwise_adagrad", "bf16", rows_form=True)
# 150 columns: two column blocks of 128 (the second one's hashes start at group 32) and a
# last group of four columns that is partial
CASES["update_rowwise_adagrad_fp16_wide"] = _update_case("rowwise_adagrad", "fp16", False, dim=150)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules define their kernels
    elif not torch.cuda.is_available():
        print('{"case": "*", "ok": false, "error": "--device cuda: no CUDA device"}')
        return 1
    os.environ.setdefault("HYBRIDREC_TRITON_AUTOTUNE", "0")
    names = args.cases or list(CASES)
    return run_all({n: CASES[n] for n in names}, args.device)


if __name__ == "__main__":
    sys.exit(main())
