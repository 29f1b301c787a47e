"""An emulated cluster on one Linux machine (docs/design.md, "The emulated cluster").

Each node is a network namespace with one veth into a bridge that lives in a separate
"switch" namespace (the host's own namespace is never touched). Each node's egress is
shaped by ``tc``: a token bucket at the chosen rate, with a netem delay inside it. Ranks
of one node share its namespace, so their traffic stays on the node (fast, unshaped) and
only traffic between nodes crosses the shaped links -- the setting of Birder's
Hierarchical-1-bit-All-Reduce. Needs root and iproute2; :func:`cluster_unavailable` says
what is missing. Names carry a random id, so concurrent runs never collide, and
:class:`EmulatedCluster` removes everything on exit, Ctrl-C, SIGTERM or failure.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from types import FrameType, TracebackType

__all__ = ["ClusterSpec", "EmulatedCluster", "cluster_unavailable", "parse_bandwidth", "parse_latency"]

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmg]?)(bit)?\s*$", re.IGNORECASE)
_BYTES_OR_BITS = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmg]?)bps\s*$", re.IGNORECASE)
_TIME = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)?\s*$", re.IGNORECASE)


def parse_bandwidth(text: str) -> float:
    """``"1gbit"``, ``"200mbit"``, ``"500k"`` -> bits per second. ``"1Gbps"`` is refused: tc reads
    ``bps`` as bytes per second, where most people mean bits, and the two differ by 8x."""
    ambiguous = _BYTES_OR_BITS.match(str(text))
    if ambiguous:
        number, prefix = ambiguous.groups()
        raise ValueError(f"bandwidth {text!r} is ambiguous: tc reads 'bps' as bytes per second ({number} "
                         f"{prefix.upper()}B/s = 8x {number} {prefix.upper()}bit/s); write '{number}{prefix.lower()}bit' "
                         "for bits per second")
    match = _RATE.match(str(text))
    if not match:
        raise ValueError(f"bandwidth must look like '1gbit', '200mbit' or '500k' (bits per second), got {text!r}")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"bandwidth must be positive, got {text!r}")
    return value


def parse_latency(text: str) -> float:
    """``"0.5ms"``, ``"100us"``, ``"0"`` -> seconds."""
    match = _TIME.match(str(text))
    if not match:
        raise ValueError(f"latency must look like '0.5ms', '100us' or '0', got {text!r}")
    return float(match.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-3}[
        match.group(2).lower() if match.group(2) else None
    ]


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` namespaces, each egress shaped to ``bandwidth`` bits/s with ``latency`` seconds of delay."""

    nodes: int
    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"nodes must be a positive int, got {self.nodes!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be positive, got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"latency must be >= 0, got {self.latency!r}")


def cluster_unavailable() -> str | None:
    """Why an emulated cluster cannot be built here, or ``None`` when it can."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces and tc need CAP_NET_ADMIN)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"the '{tool}' command (iproute2)")
    return "missing " + " and ".join(missing) if missing else None


def _run(*args: str) -> None:
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(args)} failed: {proc.stderr.strip()}")


@dataclass
class EmulatedCluster:
    """Context manager: builds the namespaces and links on enter, removes them on exit.

    ``placement(world_size)`` maps ranks to nodes (evenly, consecutive ranks per node) as
    ``(namespace, interface)`` pairs for :func:`onebit.launch.spawn`.
    """

    spec: ClusterSpec
    tag: str = field(default_factory=lambda: "ob" + secrets.token_hex(3))
    namespaces: list[str] = field(default_factory=list)
    latency_note: str | None = None  # set when the requested latency could not be applied

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def node(self, k: int) -> str:
        return f"{self.tag}-n{k}"

    def address(self, k: int) -> str:
        return f"10.{200 + k // 250}.{k % 250}.1"

    def placement(self, world_size: int) -> list[tuple[str, str]]:
        if world_size % self.spec.nodes:
            raise ValueError(f"world size {world_size} is not a multiple of nodes={self.spec.nodes}")
        per_node = world_size // self.spec.nodes
        return [(self.node(r // per_node), "eth0") for r in range(world_size)]

    def __enter__(self) -> EmulatedCluster:
        reason = cluster_unavailable()
        if reason:
            raise RuntimeError(f"cannot build an emulated cluster: {reason}")
        self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
        for sig in self._previous:
            signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through __exit__, which removes the namespaces

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        rate = f"{int(self.spec.bandwidth)}bit"
        # The token bucket holds a few ms of traffic at the line rate (at least 64 KB), as a NIC queue.
        burst = max(65536, int(self.spec.bandwidth / 8 * 0.002))
        for k in range(self.spec.nodes):
            ns, port = self.node(k), f"{self.tag}p{k}"
            self._add_namespace(ns)
            _run("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(k)}/8", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "tbf",
                 "rate", rate, "burst", str(burst), "latency", "100ms")
            if self.spec.latency > 0 and self.latency_note is None:
                try:
                    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "parent", "1:1", "handle",
                         "10:", "netem", "delay", f"{self.spec.latency * 1e6:.0f}us", "limit", "100000")
                except RuntimeError as exc:
                    if "unknown" not in str(exc):
                        raise
                    # Kernels built without sch_netem cannot delay packets; say so instead of failing.
                    self.latency_note = "latency not applied: this kernel has no netem qdisc (sch_netem)"

    def close(self) -> None:
        """Delete every namespace this cluster created (their veths and qdiscs go with them)."""
        errors = []
        while self.namespaces:
            name = self.namespaces.pop()
            proc = subprocess.run(["ip", "netns", "del", name], capture_output=True, text=True)
            if proc.returncode and "No such file" not in proc.stderr:
                errors.append(f"{name}: {proc.stderr.strip()}")
        for sig, handler in getattr(self, "_previous", {}).items():
            signal.signal(sig, handler)
        self._previous = {}
        if errors:
            raise RuntimeError("could not remove namespaces: " + "; ".join(errors))


def existing_namespaces(tag: str) -> list[str]:
    """Namespaces whose name starts with ``tag`` (what a cluster left behind, for tests)."""
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.startswith(tag)]
