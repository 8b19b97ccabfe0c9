"""Gradient compression codecs and the compressed allreduce.

    from comm.compression import get_codec, compressed_allreduce
    codec = get_codec("terngrad")                 # or none, fp16, bf16, natural, topk
    compressed_allreduce(group, flat_grad, codec, key="bucket0")   # flat_grad: average

See docs/compression.md for the methods, their wire formats and measured effect.
"""

from typing import Any

from comm.compression.allreduce import compose, compressed_allreduce, compressed_allreduce_async
from comm.compression.base import Codec, Encoded
from comm.compression.casts import Bf16Cast, Fp16Cast, NoCompression
from comm.compression.natural import NaturalCompression
from comm.compression.terngrad import TernGrad
from comm.compression.topk import TopK

CODECS: dict[str, type[Codec]] = {
    c.name: c for c in (NoCompression, Fp16Cast, Bf16Cast, TernGrad, NaturalCompression, TopK)
}


def get_codec(name: str, **kwargs: Any) -> Codec:
    """A new codec by name: ``none``, ``fp16``, ``bf16``, ``terngrad`` (``clip=2.5``),
    ``natural`` or ``topk`` (``ratio=0.01``); all take ``seed=0`` and ``rank=None``."""
    cls = CODECS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown codec {name!r}; expected one of {', '.join(CODECS)}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # an option this codec does not have
        raise ValueError(f"codec {name!r}: bad options {sorted(kwargs)}: {e}") from None


__all__ = [
    "CODECS",
    "Bf16Cast",
    "Codec",
    "Encoded",
    "Fp16Cast",
    "NaturalCompression",
    "NoCompression",
    "TernGrad",
    "TopK",
    "compose",
    "compressed_allreduce",
    "compressed_allreduce_async",
    "get_codec",
]
