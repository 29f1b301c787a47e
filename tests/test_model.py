"""The alpha-beta cost model against hand-computed volumes and the 1-bit Adam paper's volume formula."""

import dataclasses
import statistics

import pytest

from onebit.bench._model import ModelInput, collective_cost, predict, rank_bytes


def _by_name(m):
    return {p.optimizer: p for p in predict(m)}


def test_volume_matches_the_papers_formula():
    # 1-bit Adam section 7.1: 1 / (warmup + (1 - warmup) / 16) for fp16 training (about 5x).
    for warm in (0.15, 0.2):
        m = ModelInput(params=340_000_000, world_size=256, nodes=64, bandwidth=1e9, warmup_fraction=warm,
                       value_bytes=2, refresh_every=None)  # the paper's variance, never refreshed
        expect = 1 / (warm + (1 - warm) / 16 * (1 + 4 * 256 * 8 / 340_000_000))
        assert _by_name(m)["onebit_adam"].volume_reduction == pytest.approx(expect, rel=1e-6)
    assert _by_name(m)["birder"].volume_reduction == pytest.approx(16, rel=1e-3)


def test_ring_and_onebit_egress_by_hand():
    n, w = 8_000_000, 4
    m = ModelInput(params=n, world_size=w, nodes=4, bandwidth=1e9, latency=0.001)
    egress, seconds = collective_cost("allreduce_fp32", m)
    assert egress == pytest.approx(2 * 3 / 4 * 4 * n)
    assert seconds == pytest.approx(2 * 3 * 0.001 + egress * 8 / 1e9)
    packed = n / 8 + 16
    assert collective_cost("onebit", m)[0] == pytest.approx(3 / 4 * packed + 3 / 4 * packed)
    # Two ranks per node: the flat all-to-all sends twice as much out of each node; the hierarchy does not.
    m2 = ModelInput(params=n, world_size=8, nodes=4, bandwidth=1e9)
    packed8 = n / 8 + 32
    assert collective_cost("onebit", m2)[0] == pytest.approx(2 * 6 * packed8 / 8 + 7 * packed8 / 8)
    assert collective_cost("onebit_hierarchical", m2)[0] == pytest.approx(2 * 3 * packed8 / 4)
    assert rank_bytes("onebit", m) == pytest.approx(2 * 3 / 4 * packed)


def test_speedups_and_end_to_end_formula():
    m = ModelInput(params=8_400_000, world_size=4, nodes=4, bandwidth=2e8, compute=0.2, warmup_fraction=0.2)
    rows = _by_name(m)
    assert rows["adam"].stage_speedup == 1.0
    s = rows["onebit_adam"].stage_speedup
    assert s > 5
    # every 8th step after the warm-up a bf16 refresh (1-bit Adam's default), half an fp32 step's
    # bytes: counted as half of one; 1-bit LAMB has none
    assert rows["onebit_adam"].warmup_fraction == pytest.approx(0.2 + 0.8 / 8 / 2)
    assert rows["onebit_adam"].end_to_end_speedup == pytest.approx(1 / (0.25 + 0.75 / s))
    fp16 = _by_name(dataclasses.replace(m, value_bytes=2))["onebit_adam"]  # a bf16 refresh of an fp16 model
    assert fp16.warmup_fraction == pytest.approx(0.2 + 0.8 / 8)
    assert rows["onebit_lamb"].end_to_end_speedup == pytest.approx(1 / (0.2 + 0.8 / rows["onebit_lamb"].stage_speedup))
    never = _by_name(ModelInput(params=8_400_000, world_size=4, nodes=4, bandwidth=2e8, compute=0.2,
                                warmup_fraction=0.2, refresh_every=None))["onebit_adam"]
    assert never.end_to_end_speedup == pytest.approx(1 / (0.2 + 0.8 / s))
    assert rows["birder"].end_to_end_speedup == pytest.approx(rows["birder"].stage_speedup)
    # One node: nothing crosses the network, nothing to gain.
    one = _by_name(ModelInput(params=8_400_000, world_size=4, nodes=1, bandwidth=2e8, compute=0.2))
    assert one["adam"].comm_seconds == 0 and one["onebit_adam"].stage_speedup <= 1


def test_zero_one_adam_local_steps_send_nothing():
    base = dict(params=8_400_000, world_size=4, nodes=4, bandwidth=2e8, compute=0.2, warmup_fraction=0.2)
    rows = _by_name(ModelInput(**base, refresh_fraction=0.2, local_fraction=0.0, refresh_every=None))
    # refreshes in place of the warm-up and no local steps: 1-bit Adam's figures
    assert rows["zero_one_adam"].end_to_end_speedup == pytest.approx(rows["onebit_adam"].end_to_end_speedup)
    assert rows["zero_one_adam"].volume_reduction == pytest.approx(rows["onebit_adam"].volume_reduction)
    rows = _by_name(ModelInput(**base, refresh_fraction=0.02, local_fraction=0.5))
    adam, zo = rows["adam"], rows["zero_one_adam"]
    # by hand: a step is Adam's (2%), compute alone (50%) or the compressed step (48%)
    mean = 0.02 * adam.step_seconds + 0.5 * 0.2 + 0.48 * zo.step_seconds
    assert zo.end_to_end_speedup == pytest.approx(adam.step_seconds / mean)
    volume = 0.02 + 0.48 * rank_bytes("onebit", ModelInput(**base)) / rank_bytes("allreduce_full", ModelInput(**base))
    assert zo.volume_reduction == pytest.approx(1 / volume)
    with pytest.raises(ValueError, match="refresh_fraction \\+ local_fraction must be <= 1"):
        ModelInput(**base, refresh_fraction=0.6, local_fraction=0.5)


def test_diloco_sends_once_every_h_steps():
    n, h = 8_400_000, 64
    m = ModelInput(params=n, world_size=4, nodes=4, bandwidth=1e8, compute=0.2, sync_every=h)
    rows = _by_name(m)
    # the default all-gather, one rank per node: its signs (and a scale) to each of the 3 others
    gather = 3 * (n / 8 + 4)
    assert rows["diloco"].bytes_per_node == pytest.approx(gather)
    assert rows["diloco"].mean_bytes_per_node == pytest.approx(gather / h)
    # the compressed all-reduce: the all-to-all sends 3 of 4 slots, the all-gather 3 of 4 (signs + a scale per chunk)
    packed = n / 8 + 4 * 4
    sync = 3 * packed / 4 + 3 * packed / 4
    assert rows["diloco_allreduce"].bytes_per_node == pytest.approx(sync)
    assert rows["diloco_allreduce"].mean_bytes_per_node == pytest.approx(sync / h)
    # fp32 pseudo-gradients: a ring all-reduce of 4n bytes every H steps; 8-bit ones (prime, torchft): n bytes
    assert rows["diloco_fp32"].mean_bytes_per_node == pytest.approx(2 * 3 / 4 * 4 * n / h)
    assert rows["diloco_8bit"].mean_bytes_per_node == pytest.approx(2 * 3 / 4 * n / h)
    # against the fp32 all-reduce of every step: ~32 H fewer bytes with the all-reduce (the scales cost a
    # little), 64 H / w with the all-gather
    assert 0.99 * 32 * h < rows["diloco_allreduce"].volume_reduction < 32 * h
    assert 0.99 * 16 * h < rows["diloco"].volume_reduction < 16 * h
    assert rows["diloco_fp32"].volume_reduction == pytest.approx(h)
    # a step is compute alone, except one in H that waits for the exchange
    mean = (h - 1) / h * 0.2 + rows["diloco"].step_seconds / h
    assert rows["diloco"].end_to_end_speedup == pytest.approx(rows["adam"].step_seconds / mean)


def test_streamed_diloco_divides_the_peak_and_hides_the_exchange_under_its_delay():
    n, h, p = 8_400_000, 64, 4
    whole = _by_name(ModelInput(params=n, world_size=4, nodes=4, bandwidth=1e8, compute=0.2, sync_every=h))
    streamed = _by_name(ModelInput(params=n, world_size=4, nodes=4, bandwidth=1e8, compute=0.2, sync_every=h,
                                   fragments=p))
    hidden = _by_name(ModelInput(params=n, world_size=4, nodes=4, bandwidth=1e8, compute=0.2, sync_every=h,
                                 fragments=p, delay=1))
    # a synchronisation of a quarter of the model every H / 4 steps: the peak / 4, the bytes of the run the same
    assert streamed["diloco"].bytes_per_node == pytest.approx(3 * (n / p / 8 + 4))
    assert streamed["diloco"].mean_bytes_per_node == pytest.approx(whole["diloco"].mean_bytes_per_node, rel=1e-4)
    # each synchronisation's wire time (~0.06 s at 100 Mbit/s) waited for without a delay, under one step of
    # 0.2 s with delay=1: then the run is compute and the compression kernels alone
    wire = streamed["diloco"].comm_seconds
    assert 0.05 < wire < 0.08 and hidden["diloco"].comm_seconds == 0
    kernels = 3 * 4 * n / (4.5e9 * p)
    assert hidden["diloco"].step_seconds == pytest.approx(0.2 + kernels)
    mean = (1 - p / h) * 0.2 + p / h * (0.2 + kernels)
    assert hidden["diloco"].end_to_end_speedup == pytest.approx(hidden["adam"].step_seconds / mean)


def test_bad_input():
    with pytest.raises(ValueError, match="world_size=6 must be a multiple of nodes=4"):
        ModelInput(params=1, world_size=6, nodes=4, bandwidth=1e9)
    with pytest.raises(ValueError, match="value_bytes must be 2 or 4, got 8"):
        ModelInput(params=1, world_size=4, nodes=4, bandwidth=1e9, value_bytes=8)
    with pytest.raises(ValueError, match="sync_every must be a positive int, got 0"):
        ModelInput(params=1, world_size=4, nodes=4, bandwidth=1e9, sync_every=0)
    with pytest.raises(ValueError, match="sync_every=500 must be a multiple of fragments=3"):
        ModelInput(params=1, world_size=4, nodes=4, bandwidth=1e9, fragments=3)
    with pytest.raises(ValueError, match="delay must be an int in \\[0, sync_every / fragments\\), got 125"):
        ModelInput(params=1, world_size=4, nodes=4, bandwidth=1e9, fragments=4, delay=125)
    with pytest.raises(ValueError, match="refresh_every must be None or a positive int, got 0"):
        ModelInput(params=1, world_size=4, nodes=4, bandwidth=1e9, refresh_every=0)
    with pytest.raises(ValueError, match="unknown collective 'ring'"):
        collective_cost("ring", ModelInput(params=1, world_size=4, nodes=4, bandwidth=1e9))


def test_mean_interval_is_the_t_interval():
    from onebit.bench._analysis import mean_interval

    mean, half = mean_interval([1.0, 2.0, 3.0])  # sd 1, t(2) = 4.303
    assert mean == 2.0 and half == pytest.approx(4.303 / 3**0.5)
    assert mean_interval([5.0, 5.0, 5.0, 5.0]) == (5.0, 0.0)
    assert mean_interval([1.0])[1] == float("inf")
    # 12 degrees of freedom are not in the table: the smaller df's t (10: 2.228 > t(12) = 2.179), wider
    values = [float(i % 3) for i in range(13)]
    assert mean_interval(values)[1] == pytest.approx(2.228 * statistics.stdev(values) / 13**0.5)
