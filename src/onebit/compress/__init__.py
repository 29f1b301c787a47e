"""Compressors: one flat chunk to a :class:`Payload` and back. Nothing here touches the network.

Adding a compressor is one file, one entry in ``_REGISTRY`` and one row in the contract
tests' table.
"""

from __future__ import annotations

from typing import Any

from ._base import Compressor, Payload
from ._block_sign import BlockSignCompressor
from ._chunk_topk import ChunkTopKCompressor
from ._identity import IdentityCompressor
from ._sign import SignCompressor
from ._stochastic import StochasticSignCompressor
from ._topk import TopKCompressor
from ._uniform import UniformCompressor

__all__ = [
    "BlockSignCompressor",
    "ChunkTopKCompressor",
    "Compressor",
    "IdentityCompressor",
    "Payload",
    "SignCompressor",
    "StochasticSignCompressor",
    "TopKCompressor",
    "UniformCompressor",
    "available",
    "get",
]

_REGISTRY: dict[str, type[Compressor]] = {
    cls.name: cls
    for cls in (
        IdentityCompressor,
        SignCompressor,
        BlockSignCompressor,
        TopKCompressor,
        StochasticSignCompressor,
        UniformCompressor,
        ChunkTopKCompressor,
    )
}


def available() -> list[str]:
    """Names accepted by :func:`get`."""
    return sorted(_REGISTRY)


def get(name: str | Compressor, **kwargs: Any) -> Compressor:
    """A compressor by registry name (:func:`available`); instances pass through.

    Args:
        name: ``"identity"``, ``"sign"``, ``"block_sign"``, ``"topk"``, ``"stochastic_sign"``,
            ``"uniform"``, ``"chunk_topk"``, or a :class:`Compressor` (returned as it is).
        **kwargs: passed to the compressor's constructor (e.g. ``ratio=`` for ``"topk"``).

    Examples:
        >>> sign = onebit.compress.get("sign")
        >>> payload = sign.compress(torch.tensor([0.5, -1.0, 2.0, -0.25]))
        >>> [t.dtype for t in payload.tensors]  # on the wire: packed signs, one scale
        [torch.uint8, torch.float32]
        >>> sign.decompress(payload)
        tensor([ 1.1524, -1.1524,  1.1524, -1.1524])
    """
    if isinstance(name, Compressor):
        if kwargs:
            raise ValueError(f"compressor options {sorted(kwargs)} given with a Compressor instance")
        return name
    if not isinstance(name, str):
        raise TypeError(f"compressor must be a name or a Compressor, got {type(name).__name__}")
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown compressor {name!r}; available: {', '.join(available())}") from None
    return cls(**kwargs)
