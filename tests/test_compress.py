"""Contract tests shared by every compressor (one row each) plus per-compressor oracles."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _oracle import chunk_topk_compress, sign_compress
from onebit import compress

# One row per registered compressor: (name, constructor kwargs).
CONTRACT = [
    ("identity", {}),
    ("identity", {"dtype": "bf16"}),
    ("sign", {}),
    ("block_sign", {}),
    ("block_sign", {"block_size": 5}),
    ("topk", {"ratio": 0.1}),
    ("stochastic_sign", {"seed": 3}),
    ("uniform", {"bits": 1}),
    ("uniform", {"bits": 3}),
    ("chunk_topk", {"k": 3, "chunk": 16}),
    ("chunk_topk", {"k": 2, "chunk": 7, "bits": 1}),
]
ROW_IDS = [f"{n}-{kw}" for n, kw in CONTRACT]


def test_contract_table_covers_registry():
    assert {name for name, _ in CONTRACT} == set(compress.available())


def _vector(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("name,kwargs", CONTRACT, ids=ROW_IDS)
@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 200), seed=st.integers(0, 2**16))
def test_wire_spec_and_round_trip(name, kwargs, n, seed):
    c = compress.get(name, **kwargs)
    x = _vector(n, seed).reshape(1, n)
    p = c.compress(x)
    spec = c.wire_spec(n)
    assert [(t.dtype, t.numel()) for t in p.tensors] == list(spec)
    assert sum(t.numel() * t.element_size() for t in p.tensors) == c.wire_bytes(n)
    y = c.decompress(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    # A payload rebuilt from the wire (no ctx) decompresses to the same flat values.
    assert torch.equal(c.decompress(c.from_wire(p.tensors, n)), y.reshape(-1))


@pytest.mark.parametrize("name,kwargs", CONTRACT, ids=ROW_IDS)
@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 200), seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_error_feedback_identity(name, kwargs, n, seed, dtype):
    c = compress.get(name, **kwargs)
    x = _vector(n, seed, dtype)
    old = _vector(n, seed + 1) * 0.3
    err = old.clone()
    p = c.compress_ef(x, err)
    compensated = x.float() + old
    decompressed = c.decompress(p)
    assert torch.equal(err, compensated - decompressed)
    assert torch.allclose(decompressed + err, compensated, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name,kwargs", CONTRACT, ids=ROW_IDS)
def test_rejects_non_float(name, kwargs):
    c = compress.get(name, **kwargs)
    with pytest.raises(TypeError, match="x must be a floating-point tensor, got dtype=torch.int64"):
        c.compress(torch.arange(4))
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        c.compress([1.0, 2.0])


def test_sign_matches_paper():
    x = _vector(37, 1)
    c = compress.get("sign")
    y = c.decompress(c.compress(x))
    assert torch.allclose(y, sign_compress(x), rtol=1e-6)
    assert torch.allclose(y.norm(), x.norm(), rtol=1e-5)  # same magnitude as the input (section 4.3)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5), last=st.integers(1, 20),
       seed=st.integers(0, 2**16))
def test_sign_with_blocks_scales_each_block_as_the_paper_scales_a_chunk(lengths, last, seed):
    sizes = [8 * k for k in lengths] + [last]  # multiples of 8 but the last
    n = sum(sizes)
    x = _vector(n, seed) * torch.repeat_interleave(10.0 ** torch.arange(len(sizes)), torch.tensor(sizes))
    c = compress.get("sign").with_blocks(sizes)
    assert c.wire_spec(n) == ((torch.uint8, (n + 7) // 8), (torch.float32, len(sizes)))
    expect = torch.cat([sign_compress(part) for part in torch.split(x, sizes)])
    p = c.compress(x)
    assert torch.allclose(c.decompress(p), expect, rtol=1e-6)
    assert torch.equal(c.decompress(c.from_wire(p.tensors, n)), c.decompress(p))
    err = _vector(n, seed + 1)
    compensated = x + err
    q = c.compress_ef(x, err)
    assert torch.equal(err, compensated - c.decompress(q))
    # the server's average of several ranks' payloads: the mean of their decoded values
    payloads = [c.compress(_vector(n, seed + r)) for r in range(3)]
    out = torch.zeros(n)
    c.average(payloads, out)
    assert torch.allclose(out, sum(c.decompress(q) for q in payloads) / 3, rtol=1e-6, atol=1e-7)


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4), seed=st.integers(0, 2**16),
       k=st.integers(1, 5), chunk=st.integers(1, 12), bits=st.sampled_from([1, 2, 4]))
def test_chunk_topk_is_sparselocos_top_k_of_each_chunk_with_its_values_quantized(sizes, seed, k, chunk, bits):
    n = sum(sizes)
    x = _vector(n, seed) * torch.repeat_interleave(3.0 ** torch.arange(len(sizes)), torch.tensor(sizes))
    c = compress.get("chunk_topk", k=k, chunk=chunk, bits=bits, range_in_sigmas=6.0).with_blocks(sizes)
    expect = torch.cat([chunk_topk_compress(part, k, chunk, bits, 6.0) for part in torch.split(x, sizes)])
    p = c.compress(x)
    assert torch.allclose(c.decompress(p), expect, rtol=1e-5, atol=1e-6)
    kept = sum(min(k, len(range(lo, min(lo + chunk, s)))) for s in sizes for lo in range(0, s, chunk))
    # on the wire: 12 bits an index, `bits` a value, the mean and 2^bits bin values a block
    assert c.wire_bytes(n) == 3 * math.ceil(kept / 2) + math.ceil(kept * bits / 8) + 4 * len(sizes) * (1 + 2**bits)


def test_chunk_topk_defaults_send_one_value_in_64_at_146x_fewer_bytes():
    c = compress.get("chunk_topk")
    x = _vector(64 * 4096, 0)
    assert int((c.decompress(c.compress(x)) != 0).sum()) == 64 * 64
    assert round(4 * x.numel() / c.wire_bytes(x.numel())) == 146


def test_chunk_topk_arguments():
    with pytest.raises(ValueError, match=r"Invalid chunk value: 5000 \(expected an int in \[1, 4096\]\)"):
        compress.get("chunk_topk", chunk=5000)
    with pytest.raises(TypeError, match=r"Invalid k value: 1.5 \(expected an int\)"):
        compress.get("chunk_topk", k=1.5)
    with pytest.raises(ValueError, match=r"Invalid bits value: 3 \(expected 1, 2, 4 or 8\)"):
        compress.get("chunk_topk", bits=3)
    with pytest.raises(ValueError, match=r"Invalid range_in_sigmas value: 0 \(expected a positive number\)"):
        compress.get("chunk_topk", range_in_sigmas=0)
    with pytest.raises(ValueError, match="block_sizes add up to 8, the chunk has 9 values"):
        compress.get("chunk_topk").with_blocks([4, 4]).compress(torch.ones(9))


def test_blocks_arguments():
    with pytest.raises(ValueError, match="block_sizes must be multiples of 8 but the last, got \\[5, 3\\]"):
        compress.SignCompressor(block_sizes=[5, 3])
    with pytest.raises(ValueError, match="block_sizes must be ints >= 1"):
        compress.SignCompressor(block_sizes=[8, 0])
    with pytest.raises(ValueError, match="block_sizes add up to 16, the chunk has 17 values"):
        compress.SignCompressor(block_sizes=[8, 8]).compress(torch.ones(17))
    with pytest.raises(TypeError, match="TopKCompressor has no per-block scales"):
        compress.get("topk", ratio=0.5).with_blocks([8, 8])
    assert compress.get("sign").with_blocks([9]).block_sizes is None  # one block: the chunk's own scale


def test_block_sign_definition_2():
    x = torch.tensor([1.0, -3.0, 2.0, 4.0, -4.0, 0.5, -0.5])
    y = compress.get("block_sign", block_size=3).decompress(compress.get("block_sign", block_size=3).compress(x))
    # blocks [1,-3,2] -> 2, [4,-4,0.5] -> 8.5/3, [-0.5] -> 0.5
    expect = torch.tensor([2.0, -2.0, 2.0, 8.5 / 3, -8.5 / 3, 8.5 / 3, -0.5])
    assert torch.allclose(y, expect)
    whole = compress.get("block_sign")
    assert torch.allclose(whole.decompress(whole.compress(x)), torch.sign(x) * x.abs().mean())


def test_topk_keeps_largest():
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 1.0, -2.0, 0.05, 0.4])
    c = compress.get("topk", ratio=0.3)
    assert c.k(10) == 3
    y = c.decompress(c.compress(x))
    assert y.tolist() == [0, -5.0, 0, 3.0, 0, 0, 0, -2.0, 0, 0]
    assert compress.get("topk", ratio=1e-6).k(10) == 1


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 60), ranks=st.integers(1, 4), ratio=st.sampled_from([0.05, 0.3, 1.0]),
       seed=st.integers(0, 2**16))
def test_topk_average_is_the_mean_of_the_dense_payloads_in_rank_order(n, ranks, ratio, seed):
    # the server's average, written plainly: each rank's kept values in a dense vector, summed in
    # rank order, then divided; bit for bit, also added to what `out` holds (accumulate)
    c = compress.get("topk", ratio=ratio)
    xs = [_vector(n, seed + r) for r in range(ranks)]
    payloads = [c.compress(x) for x in xs]
    dense = []
    for x in xs:
        kept = torch.zeros(n)
        idx = x.abs().argsort(descending=True, stable=True)[: c.k(n)]
        kept[idx] = x[idx]
        dense.append(kept)
    total = dense[0].clone()
    for kept in dense[1:]:
        total += kept
    assert torch.equal(c.average(payloads, torch.full((n,), 7.0)), total / ranks)
    base = _vector(n, seed + 99)
    assert torch.equal(c.average(payloads, base.clone(), accumulate=True), base + total / ranks)


def test_stochastic_sign_unbiased_and_reproducible():
    x = torch.linspace(-1, 1, 41)
    c = compress.get("stochastic_sign", seed=7)
    draws = torch.stack([c.decompress(c.compress(x)) for _ in range(4000)])
    assert set(draws.unique().tolist()) <= {-1.0, 1.0}
    mean = draws.mean(0)
    # Each mean has std sqrt(1 - x^2)/sqrt(4000) <= 0.016; 5 sigma.
    assert torch.all((mean - x).abs() < 0.08), (mean - x).abs().max()
    assert mean[0] == -1 and mean[-1] == 1
    again = compress.get("stochastic_sign", seed=7)
    assert torch.equal(again.decompress(again.compress(x)), draws[0])
    # state_dict resumes the random stream exactly.
    state = c.state_dict()
    nxt = c.decompress(c.compress(x))
    fresh = compress.get("stochastic_sign", seed=0)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.decompress(fresh.compress(x)), nxt)


def test_identity_wire_dtypes():
    x = _vector(10, 0)
    assert torch.equal(compress.get("identity").decompress(compress.get("identity").compress(x)), x)
    c = compress.get("identity", dtype="fp16")
    assert c.wire_bytes(10) == 20
    assert torch.equal(c.decompress(c.compress(x)), x.half().float())


def test_registry_and_argument_errors():
    with pytest.raises(ValueError, match="unknown compressor 'nope'; available: block_sign, chunk_topk, identity"):
        compress.get("nope")
    with pytest.raises(TypeError, match="compressor must be a name or a Compressor, got int"):
        compress.get(3)
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\], got 1.5"):
        compress.get("topk", ratio=1.5)
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\], got 0"):
        compress.get("topk", ratio=0)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        compress.get("block_sign", block_size=0)
    with pytest.raises(ValueError, match="dtype must be one of .*got 'fp8'"):
        compress.get("identity", dtype="fp8")
    with pytest.raises(TypeError, match="seed must be an int, got 1.5"):
        compress.get("stochastic_sign", seed=1.5)
    sign = compress.get("sign")
    assert compress.get(sign) is sign
    with pytest.raises(ValueError, match=r"compressor options \['ratio'\] given with a Compressor instance"):
        compress.get(sign, ratio=0.1)
    assert math.isclose(compress.get("block_sign", block_size=3).alignment, 24)


def test_block_sign_explicit_blocks():
    x = torch.tensor([1.0, -3.0, 2.0, 4.0, -4.0, 0.5, -0.5])
    c = compress.get("block_sign", block_sizes=[2, 5])
    expect = torch.tensor([2.0, -2.0, 2.2, 2.2, -2.2, 2.2, -2.2])
    assert torch.allclose(c.decompress(c.compress(x)), expect)
    with pytest.raises(ValueError, match="block_sizes add up to 7, the chunk has 6 values"):
        c.compress(x[:6])
    with pytest.raises(ValueError, match="give block_size or block_sizes, not both"):
        compress.get("block_sign", block_size=2, block_sizes=[1])


def test_uniform_levels_match_paper():
    x = torch.tensor([1.2, -0.6, 0.4, 0.1, -2.0])
    three = compress.get("uniform", bits=3)  # M_3 = {-1, -2/3, -1/3, 0, 1/3, 2/3, 1} * ||x||_inf
    got = three.decompress(three.compress(x))
    expect = torch.tensor([2 / 3, -1 / 3, 1 / 3, 0.0, -1.0]) * 2.0
    assert torch.allclose(got, expect)
    one = compress.get("uniform", bits=1)
    assert torch.equal(one.decompress(one.compress(x)), torch.tensor([2.0, -2.0, 2.0, 2.0, -2.0]))
    assert three.wire_bytes(8) == 3 + 4
    with pytest.raises(ValueError, match=r"bits must be in \[1, 8\], got 9"):
        compress.get("uniform", bits=9)
