"""Top-k sparsification with error feedback (Stich et al. 2018; Lin et al., DGC 2018).

Per key, the codec keeps a residual ``r`` (what it has not sent yet). Each step::

    acc  = g + r
    sent = the k entries of acc largest in |.|   (k = max(1, ceil(ratio * numel)))
    r    = acc - sent

so ``sum(sent over steps) = sum(g over steps) - r_now``: nothing is lost, only
delayed, and the residual stays bounded (top-k keeps at least the fraction k/n of
``|acc|^2``). The codec is biased for any single step. Wire: int32 indices and
float32 values, ``8 k`` bytes.

The residual belongs to this rank's gradient for ``key``: feed the same key the same
buffer every step (its length may not change; :meth:`reset` forgets it).
"""

from __future__ import annotations

import math

import torch

from comm.compression.base import Codec, Encoded


class TopK(Codec):
    """Send the ``ratio`` fraction largest entries, keep the rest as residual per key."""

    name = "topk"
    unbiased = False

    def __init__(self, *, ratio: float = 0.01, seed: int = 0, rank: int | None = None) -> None:
        super().__init__(seed=seed, rank=rank)
        if not 0 < ratio <= 1:
            raise ValueError(f"topk: ratio must be in (0, 1], got {ratio}")
        self.ratio = float(ratio)
        self.residuals: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"TopK(ratio={self.ratio}, keys={len(self.residuals)})"

    def k_for(self, numel: int) -> int:
        """How many entries a vector of ``numel`` values sends."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def reset(self, key: str | None = None) -> None:
        if key is None:
            self.residuals.clear()
        else:
            self.residuals.pop(key, None)

    def _encode(self, t: torch.Tensor, key: str) -> Encoded:
        n = t.numel()
        residual = self.residuals.get(key)
        if residual is None:
            acc = t.clone()
        elif residual.numel() != n:
            raise ValueError(
                f"topk codec: gradient {key!r} has {n} values but its error-feedback "
                f"residual has {residual.numel()}; a key must name the same buffer every "
                "step (call reset(key) if it really changed)"
            )
        else:
            acc = residual.add_(t)  # in place: the residual buffer becomes acc
        k = self.k_for(n)
        idx = torch.topk(acc.abs(), k, sorted=False).indices  # [k]
        values = acc[idx]  # [k] float32
        acc[idx] = 0.0  # what stays behind is the new residual
        self.residuals[key] = acc
        return Encoded(payload=values, indices=idx.to(torch.int32))

    def _decode(self, e: Encoded, numel: int) -> torch.Tensor:
        assert e.indices is not None
        out = torch.zeros(numel, dtype=torch.float32, device=e.payload.device)
        out.index_put_((e.indices.long(),), e.payload.float(), accumulate=True)
        return out

    def _wire_bytes(self, numel: int) -> int:
        return 8 * self.k_for(numel)
