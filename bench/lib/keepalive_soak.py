#!/usr/bin/env python3
"""Hold many HTTP/1.1 keep-alive connections open against a proxy and watch its RSS.

Loopback only, bounded in time. Opens --connections connections (each sends one request to
prove it works), then keeps every one of them alive for --seconds with light load: each
connection sends `GET /` every --interval seconds (staggered), reconnecting if the server
closed it. VmRSS of --pid is sampled at start (before any connection), once all connections
are open, every --sample-every seconds, and at the end. Prints a JSON summary (also written
to --out).
"""
import argparse
import asyncio
import ipaddress
import json
import random
import re
import sys
import time
import urllib.request


def vmrss_kib(pid):
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        m = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)
    return int(m.group(1)) if m else -1


class Stats:
    def __init__(self):
        self.ok = 0
        self.non2xx = 0
        self.errors = 0
        self.reconnects = 0
        self.last_error = ""


async def one_request(reader, writer, host):
    writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\nUser-Agent: tollgate-bench-soak\r\n\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    closes = headers.get("connection", "").lower() == "close"
    return status, closes


async def connection(host, port, stats, opened, stop, interval):
    reader = writer = None
    first = True
    try:
        while not stop.is_set():
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection(host, port)
                    if not first:
                        stats.reconnects += 1
                status, closes = await asyncio.wait_for(one_request(reader, writer, host), 10)
                if 200 <= status < 300:
                    stats.ok += 1
                else:
                    stats.non2xx += 1
                if first:
                    first = False
                    opened.append(1)
                if closes:
                    writer.close()
                    writer = None
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError, IndexError) as e:
                stats.errors += 1
                stats.last_error = repr(e)
                if writer is not None:
                    writer.close()
                writer = None
                if first:
                    return
            try:
                await asyncio.wait_for(stop.wait(), interval * random.uniform(0.8, 1.2))
            except asyncio.TimeoutError:
                pass
    finally:
        if writer is not None:
            writer.close()


async def main(a):
    if not ipaddress.ip_address(a.host).is_loopback or (
        a.metrics_url and not a.metrics_url.startswith(("http://127.", "http://[::1]"))
    ):
        sys.exit("loopback addresses only")
    stats = Stats()
    samples = []
    t0 = time.monotonic()

    def open_gauge():
        if not a.metrics_url:
            return None
        try:
            text = urllib.request.urlopen(a.metrics_url, timeout=2).read().decode()
        except OSError:
            return None
        m = re.search(r"^tollgate_open_connections\s+(\S+)", text, re.M)
        return int(float(m.group(1))) if m else None

    def sample(phase):
        samples.append({"t": round(time.monotonic() - t0, 1), "phase": phase, "rss_kib": vmrss_kib(a.pid),
                        "server_open_connections": open_gauge()})
        print(f"  rss t={samples[-1]['t']:>6}s {phase:<6} {samples[-1]['rss_kib'] / 1024:7.1f} MiB "
              f"server_open={samples[-1]['server_open_connections']} "
              f"(ok={stats.ok} non2xx={stats.non2xx} errors={stats.errors} reconnects={stats.reconnects})",
              flush=True)

    sample("start")
    stop = asyncio.Event()
    opened = []
    tasks = []
    for i in range(a.connections):
        tasks.append(asyncio.create_task(connection(a.host, a.port, stats, opened, stop, a.interval)))
        if i % 50 == 49:
            await asyncio.sleep(0.05)  # do not overflow the accept backlog
    deadline = time.monotonic() + a.open_timeout
    while len(opened) < a.connections and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    n_open = len(opened)
    await asyncio.sleep(1)
    sample("open")
    soak_end = time.monotonic() + a.seconds
    next_sample = time.monotonic() + a.sample_every
    while time.monotonic() < soak_end:
        await asyncio.sleep(min(1.0, max(0.0, soak_end - time.monotonic())))
        if time.monotonic() >= next_sample:
            sample("soak")
            next_sample += a.sample_every
    sample("end")
    stop.set()
    await asyncio.wait(tasks, timeout=15)
    result = {
        "connections": a.connections,
        "connections_open": n_open,
        "soak_seconds": a.seconds,
        "interval_s": a.interval,
        "requests_ok": stats.ok,
        "non2xx": stats.non2xx,
        "errors": stats.errors,
        "reconnects": stats.reconnects,
        "last_error": stats.last_error,
        "samples": samples,
    }
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    rs = [s["rss_kib"] for s in samples if s["phase"] != "start"]
    print(f"connections open {n_open}/{a.connections}; RSS start {samples[0]['rss_kib'] / 1024:.1f} MiB, "
          f"with connections min {min(rs) / 1024:.1f} max {max(rs) / 1024:.1f} MiB; "
          f"requests ok={stats.ok} non2xx={stats.non2xx} errors={stats.errors} reconnects={stats.reconnects}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--connections", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--interval", type=float, default=5.0)
    p.add_argument("--sample-every", type=float, default=30)
    p.add_argument("--open-timeout", type=float, default=30)
    p.add_argument("--out", required=True)
    p.add_argument("--metrics-url", default="", help="tollgate /metrics, for its open_connections gauge")
    asyncio.run(main(p.parse_args()))
