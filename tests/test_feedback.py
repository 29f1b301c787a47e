import logging

import pytest
import torch

from onebit import ErrorFeedback, compress


def test_error_feedback_buffer_and_state_round_trip(caplog):
    fb = ErrorFeedback("worker")
    c = compress.get("sign")
    x = torch.randn(21)
    p = fb.compress(c, x)
    assert torch.equal(fb.error, x - c.decompress(p))
    again = ErrorFeedback("worker")
    again.load_state_dict(fb.state_dict())
    assert torch.equal(again.error, fb.error)
    # Both continue identically.
    y = torch.randn(21)
    assert torch.equal(c.decompress(fb.compress(c, y)), c.decompress(again.compress(c, y)))
    other = ErrorFeedback("server")
    with caplog.at_level(logging.WARNING):
        other.load_state_dict(fb.state_dict(), expect_numel=8)
    assert "server error has 21 values but 8 are expected" in caplog.text
    assert other.error is None


def test_error_feedback_rejects_resized_chunks():
    fb = ErrorFeedback("server")
    fb.buffer(4, torch.device("cpu"))
    with pytest.raises(ValueError, match="server error holds 4 values on cpu, got a chunk of 5 on cpu"):
        fb.buffer(5, torch.device("cpu"))
