"""The codec interface: ``encode`` a float32 vector into a few flat tensors, ``decode`` back.

A codec turns one gradient vector ``t`` (``[numel]``, float) into an :class:`Encoded`:
a ``payload`` plus, depending on the method, a per-tensor ``scale`` and/or ``indices``.
Those tensors are what travels between ranks; :meth:`Encoded.wire_bytes` counts them.
``decode(encoded, numel)`` gives back a float32 ``[numel]`` estimate of ``t``.

Randomness (TernGrad, natural compression): every codec owns one ``torch.Generator``
seeded from ``(seed, rank)``, so ranks draw independent noise (their errors average
out instead of adding up) and a run is reproducible: a second codec built with the
same ``seed`` and ``rank`` that encodes the same tensors in the same order gives the
same bytes. ``rank=None`` (the default) means "the rank of the first group this codec
is used with" (:func:`comm.compression.compressed_allreduce` binds it), else 0.

State: codecs with memory (top-k error feedback) keep it per ``key``, the name of
the gradient buffer (e.g. ``"bucket3"``), so one codec serves many buffers.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

# Mixes the user's seed with the rank into one generator seed (a large odd constant
# keeps (seed, rank) pairs apart; the result stays within torch's 64-bit seed range).
_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


@dataclass(slots=True)
class Encoded:
    """One encoded vector: the flat tensors that travel (shapes depend only on ``numel``).

    ``payload``: the compressed values (e.g. packed 2-bit codes ``uint8 [ceil(n/4)]``).
    ``scale``: per-tensor float32 ``[1]`` (TernGrad, natural compression) or None.
    ``indices``: int32 ``[k]`` positions of ``payload`` values (top-k) or None.
    """

    payload: torch.Tensor
    scale: torch.Tensor | None = None
    indices: torch.Tensor | None = None

    def parts(self) -> dict[str, torch.Tensor]:
        """The tensors present, by field name, in a fixed order (payload, scale, indices)."""
        out = {"payload": self.payload}
        if self.scale is not None:
            out["scale"] = self.scale
        if self.indices is not None:
            out["indices"] = self.indices
        return out

    def wire_bytes(self) -> int:
        """Bytes these tensors occupy on the wire (what one rank sends)."""
        return sum(t.numel() * t.element_size() for t in self.parts().values())


def check_vector(t: object, key: str, who: str) -> torch.Tensor:
    """``t`` as a 1-D float tensor with finite values, else ValueError naming ``key``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{who}: gradient {key!r} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(
            f"{who}: gradient {key!r} has dtype {t.dtype}; expected a floating-point tensor"
        )
    if t.dim() != 1:
        raise ValueError(
            f"{who}: gradient {key!r} has shape {tuple(t.shape)}; expected a 1-D tensor "
            "(flatten it first)"
        )
    if t.numel() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(
            f"{who}: gradient {key!r} has {bad} non-finite value(s) (NaN or Inf) among "
            f"{t.numel()}; refusing to encode it"
        )
    return t


class Codec(ABC):
    """Compresses one gradient vector at a time; see the module docstring.

    ``stats`` counts over every ``encode``: ``bytes_in`` (the vectors as float32) and
    ``bytes_on_wire`` (what the encodings occupy), plus ``calls``.
    """

    name: ClassVar[str]
    # True when E[decode(encode(t))] == t over the codec's randomness (an instance
    # may override it, e.g. TernGrad with clipping).
    unbiased: bool

    def __init__(self, *, seed: int = 0, rank: int | None = None) -> None:
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"{self.name}: seed must be an int >= 0, got {seed!r}")
        if rank is not None and (not isinstance(rank, int) or rank < 0):
            raise ValueError(f"{self.name}: rank must be an int >= 0 or None, got {rank!r}")
        self.seed = seed
        self.rank = rank
        self._gens: dict[str, torch.Generator] = {}  # by device
        self.stats: dict[str, int] = {"calls": 0, "bytes_in": 0, "bytes_on_wire": 0}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(seed={self.seed}, rank={self.rank})"

    # ------------------------------------------------------------------ rng

    def bind_rank(self, rank: int) -> None:
        """Use ``rank``'s random stream if no rank was given (called by the allreduce)."""
        if self.rank is None:
            self.rank = rank
            self._gens.clear()  # reseed on next use with the bound rank

    def generator(self, device: torch.device) -> torch.Generator:
        """This codec's generator for ``device``, seeded from ``(seed, rank or 0)`` on first
        use (CPU and CUDA draw different streams from the same seed)."""
        gen = self._gens.get(str(device))
        if gen is None:
            rank = 0 if self.rank is None else self.rank
            gen = torch.Generator(device=device)
            gen.manual_seed((self.seed * _SEED_MIX + rank + 1) & _SEED_MASK)
            self._gens[str(device)] = gen
        return gen

    # ------------------------------------------------------------------ public API

    def encode(self, t: torch.Tensor, *, key: str) -> Encoded:
        """Encode the 1-D float vector ``t`` (``[numel]``); ValueError naming ``key`` on
        a non-float, non-1-D or non-finite input."""
        check_vector(t, key, f"{self.name} codec")
        return self.encode_checked(t, key)

    def encode_checked(self, t: torch.Tensor, key: str) -> Encoded:
        """:meth:`encode` for a vector already known to be 1-D, float and finite."""
        flat = t.detach()
        if flat.dtype != torch.float32:
            flat = flat.float()
        enc = self._encode(flat, key)
        self.count(flat.numel(), enc.wire_bytes())
        return enc

    def decode(self, e: Encoded, numel: int) -> torch.Tensor:
        """The float32 ``[numel]`` vector that ``e`` stands for."""
        if numel < 0:
            raise ValueError(f"{self.name} codec: numel must be >= 0, got {numel}")
        out = self._decode(e, numel)
        assert out.shape == (numel,) and out.dtype == torch.float32, (out.shape, out.dtype)
        return out

    def expected_wire_bytes(self, numel: int) -> int:
        """Bytes :meth:`encode` puts on the wire for a vector of ``numel`` values."""
        return self._wire_bytes(numel)

    def count(self, numel: int, wire: int) -> None:
        """Add one encoded vector to ``stats``."""
        self.stats["calls"] += 1
        self.stats["bytes_in"] += 4 * numel
        self.stats["bytes_on_wire"] += wire

    def reset(self, key: str | None = None) -> None:  # noqa: B027 - stateless codecs: nothing
        """Forget per-key state (error-feedback residuals) for ``key``, or for all keys."""

    # ------------------------------------------------------------------ per method

    @abstractmethod
    def _encode(self, t: torch.Tensor, key: str) -> Encoded:
        """``t`` is float32 ``[numel]``, finite, detached."""

    @abstractmethod
    def _decode(self, e: Encoded, numel: int) -> torch.Tensor: ...

    @abstractmethod
    def _wire_bytes(self, numel: int) -> int: ...


def rebuild(template: Encoded, parts: dict[str, torch.Tensor]) -> Encoded:
    """An :class:`Encoded` like ``template`` with its tensors replaced by ``parts``."""
    return dataclasses.replace(template, **parts)
