"""Slow and half-open HTTP connections against a running server, for soak and fuzz mixes, and a
short standalone measurement of what they cost the server.

    python scripts/evil_connections.py --url http://127.0.0.1:30000 --count 5000 --requests 50

Helpers to import: `hold_half_open` (connections that send half a request header and stop),
`wait_closed` (how long until the server closes them), `half_closed_request` (a complete request,
then shutdown(SHUT_WR), read to the end), `server_fds`, `p50_generate_ms`.
The measurement prints p50 latency of small /generate requests idle, while `--count` half-open
connections are held and after the server closed them, the server's open descriptors, and how long
until the half-open ones closed.
"""

from __future__ import annotations

import argparse
import resource
import selectors
import socket
import statistics
import time
from typing import Dict, List, Optional, Tuple
from urllib.parse import urlparse

import psutil
import requests

HALF_HEADER = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Len"
SMALL_GENERATE = {"text": "Hello", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


def _address(url: str) -> Tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or 80


def raise_own_nofile(needed: int) -> int:
    """Raise this process's soft open-file limit to at least `needed` (up to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    return soft


def hold_half_open(url: str, count: int, payload: bytes = HALF_HEADER,
                   connect_timeout: float = 10.0) -> List[socket.socket]:
    """Open `count` connections that each send `payload` (half a header) and then nothing. The
    caller owns the sockets: pass them to `wait_closed`, or close them."""
    raise_own_nofile(count + 256)
    host, port = _address(url)
    socks: List[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.create_connection((host, port), timeout=connect_timeout)
            sock.sendall(payload)
            sock.setblocking(False)
            socks.append(sock)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def wait_closed(socks: List[socket.socket], timeout: float, start: Optional[float] = None) -> List[Optional[float]]:
    """Seconds from `start` (default now) until the server closed each socket (EOF or reset),
    None for one still open after `timeout`. Closes every socket before returning."""
    start = time.monotonic() if start is None else start
    closed_at: Dict[int, Optional[float]] = {i: None for i in range(len(socks))}
    with selectors.DefaultSelector() as sel:
        for i, sock in enumerate(socks):
            sel.register(sock, selectors.EVENT_READ, i)
        pending = len(socks)
        deadline = start + timeout
        while pending and time.monotonic() < deadline:
            for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
                try:
                    data = key.fileobj.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:  # an answer (such as a 408 or 503) before the close: keep reading
                    continue
                closed_at[key.data] = time.monotonic() - start
                sel.unregister(key.fileobj)
                pending -= 1
    for sock in socks:
        sock.close()
    return [closed_at[i] for i in range(len(socks))]


def half_closed_request(url: str, path: str = "/generate", body: bytes = b"", method: str = "POST",
                        timeout: float = 30.0) -> Tuple[int, bytes, bytes]:
    """Send one complete request, shut the sending side (SHUT_WR), read until the server closes.
    Returns (final status, its header block, its body); interim 1xx answers are skipped, as an
    HTTP/1.1 client must."""
    host, port = _address(url)
    head = (f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(head + body)
        sock.shutdown(socket.SHUT_WR)
        raw = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            raw += chunk
    while raw.startswith(b"HTTP/1.1 1") and b"\r\n\r\n" in raw:
        raw = raw.split(b"\r\n\r\n", 1)[1]
    headers, _, rest = raw.partition(b"\r\n\r\n")
    if not headers:
        return 0, b"", b""
    return int(headers.split(b" ", 2)[1]), headers, rest


def server_pid(url: str) -> Optional[int]:
    """The pid listening on the URL's port (this user's processes only), or None."""
    _, port = _address(url)
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return conn.pid
    return None


def server_fds(pid: int) -> int:
    return psutil.Process(pid).num_fds()


def p50_generate_ms(url: str, n: int, session: Optional[requests.Session] = None) -> float:
    """Median latency (ms) of `n` sequential /generate requests for one token."""
    session = session or requests.Session()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        resp = session.post(url + "/generate", json=SMALL_GENERATE, timeout=60)
        times.append((time.perf_counter() - t0) * 1000)
        resp.raise_for_status()
    return statistics.median(times)


def machine_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({psutil.cpu_count()} cores)"
    except OSError:
        pass
    return f"unknown CPU ({psutil.cpu_count()} cores)"


def measure(url: str, count: int, n_requests: int, pid: Optional[int], close_timeout: float) -> Dict[str, object]:
    session = requests.Session()
    p50_generate_ms(url, 3, session)  # warm-up
    idle_fds = server_fds(pid) if pid else None
    idle = p50_generate_ms(url, n_requests, session)
    t0 = time.monotonic()
    socks = hold_half_open(url, count)
    opened_s = time.monotonic() - t0
    held_fds = server_fds(pid) if pid else None
    held = p50_generate_ms(url, n_requests, session)
    closed = wait_closed(socks, close_timeout, start=t0)
    done = [c for c in closed if c is not None]
    time.sleep(0.5)
    after_fds = server_fds(pid) if pid else None
    after = p50_generate_ms(url, n_requests, session)  # the noise floor: neighbours shift every phase
    return {"count": count, "opened_s": opened_s, "idle_p50_ms": idle, "held_p50_ms": held, "after_p50_ms": after,
            "fds": (idle_fds, held_fds, after_fds), "closed": len(done),
            "closed_median_s": statistics.median(done) if done else None, "closed_max_s": max(done) if done else None}


def print_table(url: str, pid: Optional[int], r: Dict[str, object]) -> None:
    def fmt(v: object, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    fds = r["fds"]
    rows = [("machine", machine_name()), ("server", f"{url} (pid {pid or '?'})"),
            ("half-open connections", f"{r['count']} (opened in {r['opened_s']:.1f} s)"),
            ("p50 /generate idle", f"{fmt(r['idle_p50_ms'])} ms"),
            ("p50 /generate while held", f"{fmt(r['held_p50_ms'])} ms (x{r['held_p50_ms'] / r['idle_p50_ms']:.2f})"),
            ("p50 /generate after closed", f"{fmt(r['after_p50_ms'])} ms"),
            ("server fds idle / held / after", " / ".join(fmt(v, "d") for v in fds)),
            ("closed by the server", f"{r['closed']}/{r['count']}, median {fmt(r['closed_median_s'], '.2f')} s, "
                                     f"max {fmt(r['closed_max_s'], '.2f')} s after opening began")]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--count", type=int, default=1000, help="half-open connections to hold")
    ap.add_argument("--requests", type=int, default=50, help="/generate requests per p50")
    ap.add_argument("--pid", type=int, default=None, help="the server's pid (default: found by its port)")
    ap.add_argument("--close-timeout", type=float, default=120.0,
                    help="seconds to wait for the server to close the half-open connections")
    args = ap.parse_args()
    pid = args.pid or server_pid(args.url)
    result = measure(args.url, args.count, args.requests, pid, args.close_timeout)
    print_table(args.url, pid, result)


if __name__ == "__main__":
    main()
