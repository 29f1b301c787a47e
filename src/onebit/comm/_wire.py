"""Laying payloads into fixed-size byte slots, and reading them back (no network here)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..compress import Compressor, Payload

__all__ = ["read_payload", "write_payload"]


def write_payload(payload: Payload, slot: Tensor) -> None:
    """Copy the payload's tensors, back to back, into the uint8 ``slot`` (unused tail bytes stay)."""
    offset = 0
    for t in payload.tensors:
        raw = t.detach().reshape(-1).contiguous().view(torch.uint8)
        slot[offset : offset + raw.numel()].copy_(raw)
        offset += raw.numel()
    if offset > slot.numel():
        raise ValueError(f"payload of {offset} bytes overflows its {slot.numel()}-byte slot")


def read_payload(compressor: Compressor, slot: Tensor, numel: int) -> Payload:
    """The payload of ``numel`` values laid out in ``slot`` by :func:`write_payload`."""
    offset = 0
    tensors = []
    for dtype, length in compressor.wire_spec(numel):
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = slot[offset : offset + length * itemsize]
        # A wider dtype can only be viewed at an aligned address; the misaligned pieces are tiny (scales).
        if (raw.storage_offset() % itemsize) or (raw.data_ptr() % itemsize):
            raw = raw.clone()
        tensors.append(raw.view(dtype))
        offset += length * itemsize
    return compressor.from_wire(tuple(tensors), numel)
