"""The servers' ports are probed below the ephemeral range, where no outgoing connection can take one between the
probe and the server's bind (tests/ports.py)."""

import socket

from tests.ports import ephemeral_start, free_port


def test_a_free_port_is_below_the_ephemeral_range_and_can_be_bound():
    ports = {free_port() for _ in range(20)}
    assert all(port < ephemeral_start() for port in ports)
    assert len(ports) > 1  # chosen at random: two workers rarely probe the same one
    for port in ports:
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))
