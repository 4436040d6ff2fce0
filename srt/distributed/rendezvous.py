"""The TP group's rendezvous store, bound to one address.

torch's `tcp://` rendezvous makes rank 0's `TCPStore` listen on every interface (`::`, dual
stack), so anything that reaches the port could read or write the group's keys. Rank 0 here binds
the listening socket itself, to the init method's host only (127.0.0.1 on one node, the
`--dist-init-addr` host across nodes), and hands it to the store (`master_listen_fd`).
"""

from __future__ import annotations

import datetime
import logging
import socket
from typing import Tuple
from urllib.parse import urlparse

import torch.distributed as dist

logger = logging.getLogger(__name__)


def parse_tcp_init_method(init_method: str) -> Tuple[str, int]:
    """`tcp://host:port` (an IPv6 host in brackets) -> (host, port)."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        raise ValueError(f"The TP init method must be tcp://host:port, got {init_method!r} "
                         f"(set by --dist-init-addr host:port across nodes).")
    return url.hostname, url.port


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket bound to `host:port` alone: the first address of `host` that binds."""
    errors = []
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(socket.SOMAXCONN)
            return sock
        except OSError as exc:
            sock.close()
            errors.append(f"{addr[0]}: {exc}")
    raise OSError(f"Cannot listen on {host}:{port} for the TP rendezvous ({'; '.join(errors) or 'no address'}); "
                  f"pick a free port or a local address with --dist-init-addr.")


def create_tcp_store(init_method: str, rank: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's store: its server (on rank 0, listening on the init method's host only), or a
    client of it. Rank 0's constructor waits until all `world_size` ranks have connected."""
    host, port = parse_tcp_init_method(init_method)
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    sock = bind_listen_socket(host, port)
    bound = sock.getsockname()[0]
    # The store owns the descriptor from here on and closes it when it is destroyed.
    store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, master_listen_fd=sock.detach())
    logger.info("TP rendezvous store listening on %s:%d only.", bound, port)
    return store
