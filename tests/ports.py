"""Ports for the servers the tests start (engines, gateways, Redis, S3), chosen below the kernel's ephemeral range.

A port the kernel hands out for bind(("127.0.0.1", 0)) comes from the ephemeral range (ip_local_port_range), the
same range every outgoing connection takes its source port from: between the probe and the server's own bind, a
connection of any process may take it, and the server exits with "address already in use" (seen with two xdist
workers' stacks on one machine). Below that range only listeners are, and the probe sees them."""

import random
import socket
from pathlib import Path

LOWEST = 20000
RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
CHOICE = random.Random()  # seeded from the OS, apart from the global generator a test may seed


def ephemeral_start() -> int:
    try:
        return int(RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port that no socket holds now, at random below the ephemeral range."""
    highest = max(ephemeral_start(), LOWEST + 1000)
    for _ in range(200):
        port = CHOICE.randrange(LOWEST, highest)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port between {LOWEST} and {highest}")
