import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _fused_check import check_fused_ops, check_stochastic_sign, random_blocks
from _oracle import SplitMix64
from onebit import ops

lengths = st.integers(min_value=0, max_value=300)


def plain_pack(bits: list[bool]) -> list[int]:
    out = []
    for i in range(0, len(bits), 8):
        out.append(sum(1 << k for k, b in enumerate(bits[i : i + 8]) if b))
    return out


@settings(max_examples=60, deadline=None)
@given(n=lengths, seed=st.integers(0, 2**16))
def test_pack_bits_layout_and_round_trip(n, seed):
    bits = torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.5
    expect = plain_pack(bits.tolist())
    fast = ops.pack_bits(bits)
    with ops.reference_kernels():
        ref = ops.pack_bits(bits)
        ref_back = ops.unpack_bits(ref, n)
    assert fast.tolist() == expect
    assert ref.tolist() == expect
    assert torch.equal(ops.unpack_bits(fast, n), bits)
    assert torch.equal(ref_back, bits)


@settings(max_examples=60, deadline=None)
@given(n=lengths, seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_pack_signs_fast_equals_reference(n, seed, dtype):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    fast = ops.pack_signs(x)
    with ops.reference_kernels():
        ref = ops.pack_signs(x)
    assert torch.equal(fast, ref)
    assert fast.numel() == math.ceil(n / 8)
    assert ops.unpack_signs(fast, n, 2.5).tolist() == [(-2.5 if v < 0 or (v == 0 and math.copysign(1, v) < 0) else 2.5) for v in x.float().tolist()]


def test_signed_zero_and_tail_bits():
    x = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.0, -3.0, 0.5, -0.5, 7.0, -7.0])
    packed = ops.pack_signs(x)
    assert packed.tolist() == [0b01010101, 0b01]
    with ops.reference_kernels():
        assert ops.pack_signs(x).tolist() == [0b01010101, 0b01]


def test_fused_ef_matches_formula():
    g = torch.Generator().manual_seed(0)
    x, e = torch.randn(1001, generator=g), torch.randn(1001, generator=g) * 0.1
    c = x + e
    scale = torch.linalg.vector_norm(c) / math.sqrt(c.numel())
    err = e.clone()
    packed, s = ops.ef_sign_compress_(err, x)
    assert torch.allclose(s, scale.reshape(1), rtol=1e-6)
    q = torch.where(torch.signbit(c), -s, s)
    assert torch.equal(ops.unpack_signs(packed, 1001, s), q)
    assert torch.equal(err, c - q)


def test_bad_inputs():
    with pytest.raises(TypeError, match="bits must be a bool tensor"):
        ops.pack_bits(torch.ones(3))
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        ops.pack_signs(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="numel=17 does not fit in 2 packed bytes"):
        ops.unpack_bits(torch.zeros(2, dtype=torch.uint8), 17)
    with pytest.raises(ValueError, match="out must be a contiguous torch.uint8 tensor of 1 elements"):
        ops.pack_bits(torch.ones(3, dtype=torch.bool), out=torch.empty(5, dtype=torch.uint8))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 200), world=st.integers(1, 11), seed=st.integers(0, 2**16), accumulate=st.booleans())
def test_fused_kernels_bit_identical_to_reference(n, world, seed, accumulate):
    check_fused_ops(n, world, torch.Generator().manual_seed(seed), accumulate)
    g = torch.Generator().manual_seed(seed)  # and with one scale per block
    check_fused_ops(n, world, g, accumulate, blocks=random_blocks(n, g))
    check_stochastic_sign(n, torch.Generator().manual_seed(seed))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 300), seed=st.integers(0, 2**16), scale=st.floats(1e-3, 1e3))
def test_elementwise_kernels_bit_identical_to_reference(n, seed, scale):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10
    bound = torch.rand(n, generator=g)
    ref = torch.randn(n, generator=g)
    ref[torch.rand(n, generator=g) < 0.3] = 0.0
    ref[torch.rand(n, generator=g) < 0.1] = -0.0  # equal to 0.0, as torch's == says
    eps = torch.randn(n, generator=g)
    eps[torch.rand(n, generator=g) < 0.3] = 1e-8  # 1-bit Adam's marker: sqrt(v) + eps == eps (fp32)
    x[torch.rand(n, generator=g) < 0.1] = -0.0
    for fn, args in ((ops.clamp_scaled_, (bound, scale)), (ops.zero_where_equal_, (ref, 0.0)),
                     (ops.zero_where_equal_, (eps, 1e-8))):
        fast = fn(x.clone(), *args)
        with ops.reference_kernels():
            expect = fn(x.clone(), *args)
        assert torch.equal(fast.view(torch.int32), expect.view(torch.int32)), fn.__name__
    # Plain definitions: clamp to +-bound*scale, and a masked fill.
    limit = bound * scale
    assert torch.equal(ops.clamp_scaled_(x.clone(), bound, scale), torch.minimum(torch.maximum(x, -limit), limit))
    assert torch.equal(ops.zero_where_equal_(x.clone(), ref, 0.0), torch.where(ref == 0, 0.0, x))
    assert torch.equal(ops.zero_where_equal_(x.clone(), eps, 1e-8), torch.where(eps == 1e-8, 0.0, x))


@settings(max_examples=40, deadline=None)
@given(n=st.sampled_from([0, 1, 7, 8, 67, 300, 4099]), seed=st.integers(0, 2**16),
       beta=st.sampled_from([0.0, 0.9, 0.95]), first=st.booleans())
def test_soft_sign_bit_identical_to_reference(n, seed, beta, first):
    if ops._elementwise._torch_add_rounds_once() is None:
        pytest.skip("torch rounds add_(alpha=) neither way on every value here: no kernel runs")
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)  # magnitudes over decades
    grad[torch.rand(n, generator=g) < 0.2] = 0.0  # rows never looked up
    grad[torch.rand(n, generator=g) < 0.05] = -0.0
    m = torch.randn(n, generator=g) * 1e-2
    b = m.abs() + torch.rand(n, generator=g) * 1e-2  # |m| <= b, as the EMAs of g and |g| keep it
    if first:  # Birder's first step: b == 0 where the gradient is 0, so m / (0 + eps)
        m.zero_(), b.zero_()
    for special in (float("inf"), float("nan")):
        if n > 3:
            grad[n // 3] = special
    fast = [m.clone(), b.clone(), torch.empty(n)]
    ops.soft_sign_(fast[0], fast[1], grad, fast[2], beta=beta, eps=1e-8)
    expect = [m.clone(), b.clone(), torch.empty(n)]
    with ops.reference_kernels():
        ops.soft_sign_(expect[0], expect[1], grad, expect[2], beta=beta, eps=1e-8)
    for name, a, e in zip(("m", "b", "out"), fast, expect):
        assert torch.equal(a.view(torch.int32), e.view(torch.int32)), name
    # Plain definition (float64, close): the EMAs of g and |g|, then m / (b + eps)
    m64 = beta * m.double() + (1 - beta) * grad.double()
    b64 = beta * b.double() + (1 - beta) * grad.double().abs()
    finite = torch.isfinite(grad)
    size = (beta * m.double().abs() + (1 - beta) * grad.double().abs())[finite]  # rounding is relative to it
    assert ((fast[0].double()[finite] - m64[finite]).abs() <= 1e-6 * size).all()
    assert ((fast[1].double()[finite] - b64[finite]).abs() <= 1e-6 * b64[finite]).all()
    direction = m64 / (b64 + 1e-8)
    assert ((fast[2].double() - direction)[finite].abs() <= 1e-5 * (size / (b64[finite] + 1e-8) + 1)).all()
    assert (fast[2][finite].abs() <= 1 + 1e-6).all()


def test_soft_sign_bit_identical_where_torch_rounds_twice():
    """Under ATEN_CPU_CAPABILITY=default torch's add_(alpha=) rounds the product and the sum apart:
    the kernel's other path, checked against the torch form there."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    probe = "from onebit.ops._elementwise import _torch_add_rounds_once as f; print(f())"
    found = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    if found.stdout.strip() != "False":  # aarch64's default build fuses them (NEON)
        pytest.skip(f"torch's default CPU kernels round once here ({found.stdout.strip()})")
    test = f"{__file__}::test_soft_sign_bit_identical_to_reference"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 300), seed=st.integers(0, 2**16), none_seen=st.booleans())
def test_max_ratio_bit_identical_to_reference(n, seed, none_seen):
    g = torch.Generator().manual_seed(seed)
    num = torch.rand(n, generator=g) * 3
    den = torch.rand(n, generator=g) ** 4  # some quotients far larger than others
    den[torch.rand(n, generator=g) < (1.0 if none_seen else 0.3)] = 0.0  # values without a variance
    default = torch.tensor(0.75, dtype=torch.float64)
    fast = ops.max_ratio(num, den, default)
    with ops.reference_kernels():
        expect = ops.max_ratio(num, den, default, work=torch.empty(n))
    assert fast.dtype == torch.float64 and torch.equal(fast, expect)
    seen = den > 0
    plain = max((float(a / b) for a, b, s in zip(num.tolist(), den.tolist(), seen.tolist()) if s), default=0.75)
    assert float(fast) == (float((num[seen] / den[seen]).max()) if seen.any() else 0.75)
    assert math.isclose(float(fast), plain, rel_tol=1e-6)


@settings(max_examples=40, deadline=None)
@given(blocks=st.integers(0, 40), size=st.sampled_from([1, 5, 64, 4095, 4096, 5000]), tail=st.integers(0, 70),
       seed=st.integers(0, 2**16))
def test_block_l1_norms_equal_each_blocks_l1_norm(blocks, size, tail, seed):
    g = torch.Generator().manual_seed(seed)
    n = blocks * size + min(tail, size - 1)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)  # magnitudes over decades
    expect = torch.stack([ops.l1_norm(part) for part in x.split(size)]) if n else torch.zeros(0)
    assert torch.equal(ops.block_l1_norms(x, size), expect)
    assert ops.block_l1_norms(torch.zeros(0), size).numel() == 0


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 300), bits=st.integers(2, 8), seed=st.integers(0, 2**16), zero=st.booleans())
def test_uniform_codes_bit_identical_to_reference(n, bits, seed, zero):
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(n) if zero else torch.randn(n, generator=g)
    x[torch.rand(n, generator=g) < 0.1] = -0.0
    scale = ops.max_abs(x).reshape(1) if n else torch.zeros(1)
    packed = ops.pack_codes(x, scale, bits)
    with ops.reference_kernels():
        ref = ops.pack_codes(x, scale, bits)
        ref_values = ops.unpack_codes(ref, n, bits, scale, torch.empty(n))
    assert torch.equal(packed, ref)
    values = ops.unpack_codes(packed, n, bits, scale, torch.empty(n))
    assert torch.equal(values.view(torch.int32), ref_values.view(torch.int32))
    # Plainly: value i's code is round(x / scale * L) + L, its bits at i * bits + k.
    levels = (1 << (bits - 1)) - 1
    safe = float(scale) if n and float(scale) > 0 else 1.0
    stream = ops.unpack_bits(packed, n * bits).view(n, bits).long()
    codes = (stream << torch.arange(bits)).sum(1)
    assert torch.equal(codes, torch.round(x / safe * levels).long() + levels)
    assert torch.equal(values, (codes.float() - levels) / levels * scale)


def plain_topk(values: list[float], k: int) -> list[int]:
    """The k largest magnitudes' indices, ascending: by magnitude (a NaN above everything), then
    the lowest index first."""
    def rank(i: int) -> tuple[bool, float, int]:
        v = values[i]
        return (not math.isnan(v), -abs(v) if not math.isnan(v) else 0.0, i)
    return sorted(sorted(range(len(values)), key=rank)[:k])


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 400), fraction=st.floats(0.0, 1.0), seed=st.integers(0, 2**16),
       palette=st.sampled_from(["randn", "ties", "zeros", "special"]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_topk_indices_are_the_largest_magnitudes_lowest_index_first(n, fraction, seed, palette, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if palette == "ties":  # many equal magnitudes of both signs: the threshold's ties decide
        x = torch.randint(-3, 4, (n,), generator=g).float()
    elif palette == "zeros":  # a sparse gradient: fewer non-zeros than k
        x[torch.rand(n, generator=g) < 0.9] = 0.0
        x[torch.rand(n, generator=g) < 0.2] = -0.0
    elif palette == "special":
        x[torch.randint(0, n, (3,), generator=g)] = torch.tensor([math.nan, math.inf, -math.inf])
    x = x.to(dtype)
    k = round(fraction * n)
    fast = ops.topk_indices(x, k)
    with ops.reference_kernels():
        expect = ops.topk_indices(x, k)
    assert fast.dtype == expect.dtype == torch.int32
    assert fast.tolist() == expect.tolist() == plain_topk(x.double().tolist(), k)


def test_topk_indices_across_the_radix_bins():
    # 0.7M values: many in the threshold's high bin, so its low bits settle it
    g = torch.Generator().manual_seed(0)
    x = torch.randn(700_000, generator=g)
    x[::5] = 0.0
    x[1::7] = x[3]  # ties exactly at a common magnitude
    for k in (1, 7_000, 100_000, 600_000, 700_000):
        fast = ops.topk_indices(x, k)
        with ops.reference_kernels():
            expect = ops.topk_indices(x, k)
        assert torch.equal(fast, expect)
        kept = torch.zeros(x.numel(), dtype=torch.bool)
        kept[fast.long()] = True
        assert int(kept.sum()) == k and bool((fast[1:] > fast[:-1]).all())
        assert x.abs()[kept].min() >= x.abs()[~kept].max() if k < x.numel() else True


def test_topk_indices_bad_input():
    with pytest.raises(ValueError, match=r"k must be an int in \[0, 3\].*got 4"):
        ops.topk_indices(torch.ones(3), 4)
    with pytest.raises(ValueError, match="got 1.5"):
        ops.topk_indices(torch.ones(3), 1.5)
    with pytest.raises(TypeError, match="floating-point tensor, got torch.int64"):
        ops.topk_indices(torch.ones(3, dtype=torch.int64), 1)


def test_splitmix_uniform_is_the_splitmix64_stream():
    # SplitMix64 seeded 0 (the published reference outputs): 0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4
    stream = SplitMix64(0)
    assert [stream.next(), stream.next()] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]
    assert ops.splitmix_uniform(0, 0, 2).tolist() == [0xE220A8 / 2**24, 0x6E789E / 2**24]
    for seed, offset in ((5, 0), (2**64 - 3, 10**12), (11 + 3 * 2**32, 999)):
        stream = SplitMix64(seed)
        skipped = [stream.next() for _ in range(offset)] if offset < 10**6 else None
        if skipped is None:  # jump: the state after `offset` outputs
            stream.state = (seed + offset * 0x9E3779B97F4A7C15) % 2**64
        assert torch.equal(ops.splitmix_uniform(seed, offset, 500), stream.uniform(500))
    with pytest.raises(ValueError, match="offset must be a non-negative int, got -1"):
        ops.splitmix_uniform(0, -1, 3)
    with pytest.raises(ValueError, match="seed must be an int, got 1.5"):
        ops.splitmix_uniform(1.5, 0, 3)
