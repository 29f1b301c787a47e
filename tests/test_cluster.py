"""The emulated cluster: parsing, clean-up on success, failure and Ctrl-C, and a run inside it."""

import json

import pytest

from onebit.bench._cluster import (
    ClusterSpec,
    EmulatedCluster,
    cluster_unavailable,
    existing_namespaces,
    parse_bandwidth,
    parse_latency,
)
from onebit.cli import main

needs_root = pytest.mark.skipif(cluster_unavailable() is not None, reason=f"{cluster_unavailable()}")


def test_parsing():
    assert parse_bandwidth("1gbit") == 1e9
    assert parse_bandwidth("200mbit") == 2e8
    assert parse_bandwidth("1Gbit") == parse_bandwidth("1g") == 1e9
    for ambiguous, bits in (("10mbps", "10mbit"), ("1Gbps", "1gbit")):  # tc: bytes/s; most people: bits/s
        with pytest.raises(ValueError, match=f"{ambiguous!r} is ambiguous.*write '{bits}'"):
            parse_bandwidth(ambiguous)
    assert parse_latency("0.5ms") == pytest.approx(5e-4)
    assert parse_latency("100us") == pytest.approx(1e-4)
    for bad in ("", "fast", "-1gbit", "1 tbit"):
        with pytest.raises(ValueError, match="bandwidth must look like"):
            parse_bandwidth(bad)
    with pytest.raises(ValueError, match="nodes must be a positive int, got 0"):
        ClusterSpec(0, 1e9)


@needs_root
def test_cleanup_after_success_error_and_ctrl_c():
    for exc in (None, RuntimeError("boom"), KeyboardInterrupt()):
        cluster = EmulatedCluster(ClusterSpec(2, 1e8))
        try:
            with cluster:
                assert len(existing_namespaces(cluster.tag)) == 3  # switch + 2 nodes
                assert cluster.placement(4) == [(cluster.node(0), "eth0")] * 2 + [(cluster.node(1), "eth0")] * 2
                if exc is not None:
                    raise exc
        except (RuntimeError, KeyboardInterrupt) as caught:
            assert caught is exc
        assert existing_namespaces(cluster.tag) == []


@needs_root
def test_cluster_command_checks_the_link_and_removes_everything(capsys):
    assert main(["cluster", "--nodes", "2", "--bandwidth", "100mbit", "--check-mb", "2"]) == 0
    text = capsys.readouterr().out
    assert "link check" in text and ": ok" in text
    rate = float(text.split(" Gbit/s (")[0].split()[-1])
    assert 0.05 < rate < 0.11  # shaped to 0.1 Gbit/s


@needs_root
def test_train_inside_the_cluster(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--optimizer", "birder", "--world-size", "4", "--nodes", "2", "--hierarchical",
                 "--steps", "3", "--batch-size", "4", "--hidden", "32", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "birder" / "summary.json").read_text())
    assert summary["cluster"]["nodes"] == 2 and summary["finite"]
