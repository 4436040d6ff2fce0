"""Rank 0's rendezvous store listens on the init method's host only (127.0.0.1 on one node), not on
every interface as torch's own `tcp://` rendezvous does; the group it builds still all-reduces."""

from __future__ import annotations

import datetime
import socket

import psutil
import pytest
import torch.distributed as dist

from server_utils import free_port
from tp_utils import run_on_ranks

WILDCARDS = {"0.0.0.0", "::"}
TIMEOUT = datetime.timedelta(seconds=60)


def _listening_ips(port: int) -> set:
    """The local addresses this process listens on at `port` (psutil, not our own bookkeeping)."""
    conns = psutil.Process().net_connections(kind="inet")
    return {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def _join_and_all_reduce(rank: int, tp: int, init_method: str):
    import torch

    from srt.distributed.parallel_state import get_tp_group, init_tp_group, tensor_model_parallel_all_reduce
    from srt.distributed.rendezvous import parse_tcp_init_method

    group = init_tp_group(tp, rank, init_method, "cpu")
    _, port = parse_tcp_init_method(init_method)
    listening = _listening_ips(port)
    x = torch.arange(4, dtype=torch.float32) * (rank + 1)
    tensor_model_parallel_all_reduce(x)
    return dict(listening=listening, reduced=x.tolist(), backend=group.backend, world=get_tp_group().world_size)


def test_rank0_store_listens_on_loopback_only_and_the_group_all_reduces():
    rank0, rank1 = run_on_ranks(_join_and_all_reduce, 2)
    assert rank0["listening"] == {"127.0.0.1"}, rank0["listening"]
    assert not rank0["listening"] & WILDCARDS
    assert rank1["listening"] == set(), "only rank 0 hosts the store"
    expected = [0.0, 3.0, 6.0, 9.0]  # arange(4) * (1 + 2)
    assert rank0["reduced"] == expected and rank1["reduced"] == expected
    assert rank0["backend"] == "gloo" and rank0["world"] == rank1["world"] == 2


def test_torchs_own_master_store_would_listen_on_every_interface():
    """Why the store is built by hand: given only a host and a port, TCPStore binds the wildcard."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=TIMEOUT)
    try:
        assert _listening_ips(port) & WILDCARDS, _listening_ips(port)
    finally:
        del store


def _interface_address() -> str:
    """A non-loopback IPv4 address of this machine (a node's address in a multi-node group)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    pytest.skip("this machine has no non-loopback IPv4 address")


@pytest.mark.parametrize("which", ["interface", "loopback-alias"])
def test_a_multi_node_host_is_the_only_address_listened_on(which):
    """--dist-init-addr HOST:PORT: rank 0 listens on HOST, not also on 127.0.0.1 or the wildcard."""
    from srt.distributed.rendezvous import create_tcp_store

    host, port = _interface_address() if which == "interface" else "127.0.0.2", free_port()
    store = create_tcp_store(f"tcp://{host}:{port}", 0, 1, TIMEOUT)
    try:
        assert _listening_ips(port) == {host}
        client = dist.TCPStore(host, port, 1, is_master=False, timeout=TIMEOUT)
        store.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        del store


@pytest.mark.parametrize("method", ["env://", "tcp://host-without-port", "file:///tmp/x"])
def test_a_malformed_init_method_names_the_flag(method):
    from srt.distributed.rendezvous import parse_tcp_init_method

    with pytest.raises(ValueError, match="--dist-init-addr"):
        parse_tcp_init_method(method)


def test_a_port_already_taken_is_an_error_naming_the_flag():
    from srt.distributed.rendezvous import bind_listen_socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(OSError, match="--dist-init-addr"):
            bind_listen_socket("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()
