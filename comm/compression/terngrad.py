"""TernGrad (Wen et al., NeurIPS 2017): stochastic ternary gradients with one scale.

For a vector ``g`` (one key: a layer or a bucket) with scale ``s = max|g|``::

    b_i in {-1, 0, +1},  P(b_i = sign(g_i)) = |g_i| / s,  otherwise b_i = 0
    decode: s * b                                   E[s * b_i] = g_i  (unbiased)

Gradient clipping (the paper's section 3.3): before the scale is taken, values are
clamped to ``[-c*sigma, c*sigma]`` with ``sigma`` the standard deviation of ``g``
(``c = 2.5`` by default, as in the paper). It shrinks ``s`` and so the variance of
the estimate, at the price of a bias on the clipped outliers; ``clip=None`` turns
it off and makes the codec unbiased. A vector with ``sigma = 0`` (all values equal)
is not clipped.

Wire: each value is a 2-bit code (0 -> 0, 1 -> +1, 2 -> -1), four to a byte, little
end first, plus the float32 scale: ``ceil(numel / 4) + 4`` bytes (16x less than
float32 for large vectors).
"""

from __future__ import annotations

import torch

from comm.compression.base import Codec, Encoded


def _shifts(device: torch.device) -> torch.Tensor:
    """uint8 ``[4]``: the bit offsets 0, 2, 4, 6 of the four codes in a byte, made on
    ``device`` (copying a host table to a GPU would stop the host for the copy)."""
    return torch.arange(0, 8, 2, dtype=torch.uint8, device=device)


def pack_2bit(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` uint8 ``[n]`` with values < 4 -> uint8 ``[ceil(n/4)]``, 4 codes per byte."""
    n = codes.numel()
    padded = torch.zeros(4 * ((n + 3) // 4), dtype=torch.uint8, device=codes.device)
    padded[:n] = codes
    quads = padded.view(-1, 4) << _shifts(codes.device)  # [ceil(n/4), 4], each in its bit pair
    return quads.sum(dim=1, dtype=torch.uint8)  # bit pairs do not overlap: sum == or


def unpack_2bit(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_2bit`: uint8 ``[n]`` codes."""
    quads = (packed.view(-1, 1) >> _shifts(packed.device)) & 3  # [ceil(n/4), 4]
    return quads.reshape(-1)[:n]


class TernGrad(Codec):
    """Stochastic ternary codes and a per-key float32 scale; see the module docstring."""

    name = "terngrad"
    unbiased = True  # with clip=None; an instance with clipping sets False

    def __init__(self, *, clip: float | None = 2.5, seed: int = 0, rank: int | None = None) -> None:
        super().__init__(seed=seed, rank=rank)
        if clip is not None and not clip > 0:
            raise ValueError(
                f"terngrad: clip must be > 0 (in standard deviations) or None, got {clip}"
            )
        self.clip = clip
        self.unbiased = clip is None  # clipping biases the outliers

    def __repr__(self) -> str:
        return f"TernGrad(clip={self.clip}, seed={self.seed}, rank={self.rank})"

    def _encode(self, t: torch.Tensor, key: str) -> Encoded:
        # Scale and clipping bound stay 0-d tensors on t's device: no host sync per call.
        g = t
        if self.clip is not None and g.numel() > 1:
            bound = g.std(correction=0) * self.clip  # 0-d
            # sigma = 0 (all values equal): not clipped.
            g = torch.where(bound > 0, torch.minimum(torch.maximum(g, -bound), bound), g)
        s = g.abs().amax() if g.numel() else torch.zeros((), device=g.device)  # 0-d
        # P(keep) = |g| / s; s = 0 only when every value is 0 (then nothing is kept).
        prob = g.abs() / torch.where(s > 0, s, 1.0)  # [n] in [0, 1]
        u = torch.rand(g.numel(), generator=self.generator(g.device), device=g.device)
        keep = u < prob
        codes = torch.where(g < 0, 2, 1).to(torch.uint8) * keep
        scale = s.reshape(1).to(torch.float32)
        return Encoded(payload=pack_2bit(codes), scale=scale)

    def _decode(self, e: Encoded, numel: int) -> torch.Tensor:
        assert e.scale is not None
        codes = unpack_2bit(e.payload, numel)
        # code 0 -> 0, 1 -> +1, 2 -> -1 (3 is never produced)
        values = (codes == 1).float() - (codes == 2).float()  # [n]
        return values * e.scale.float()

    def _wire_bytes(self, numel: int) -> int:
        return (numel + 3) // 4 + 4
