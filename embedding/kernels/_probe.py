"""A trivial Triton kernel, built and run once per process before the real ones are used.

Its first launch makes Triton compile the kernel and build its C launcher, which is
what fails on a machine without a C compiler or ``Python.h``; see
:func:`embedding.kernels.triton_builds`. Imported only by that probe: ``triton``
must be importable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_one_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=m, other=0.0) + 1.0, mask=m)


def run_probe(device: torch.device) -> None:
    """Launch the kernel on ``device`` and check its result; raises on any failure."""
    x = torch.arange(16, dtype=torch.float32, device=device)  # [16]
    out = torch.empty_like(x)
    _add_one_kernel[(1,)](x, out, x.numel(), BLOCK=16)
    if not torch.equal(out.cpu(), x.cpu() + 1.0):  # one sync, once per process
        raise RuntimeError(f"the probe kernel computed {out.cpu().tolist()} on {device}")
