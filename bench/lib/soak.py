#!/usr/bin/env python3
"""Soak driver for tollgate: floods and slow clients together, on loopback only, bounded.

Started by bench/soak.sh, which runs the tollgate instances. This script:
- runs a counting upstream (every request it receives is timestamped);
- floods the limited route of every instance with keep-alive HTTP/1.1 clients;
- holds slow clients: connections that trickle header bytes (slowloris) and connections
  that send a body slowly;
- samples each tollgate's VmRSS every few seconds;
- at the end, checks that no fixed window let more requests reach the upstream than the
  limit allows, and prints the figures as JSON.

Everything targets 127.0.0.1 and stops after --seconds.
"""

import argparse
import asyncio
import json
import os
import sys
import time


class Upstream:
    """A minimal HTTP/1.1 server answering 200 and recording arrival times."""

    def __init__(self):
        self.arrivals = []

    async def handle(self, reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1].strip() or 0)
                if length:
                    await reader.readexactly(length)
                self.arrivals.append(time.time())
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


async def flood_client(port, path, stop, counts):
    """One keep-alive connection sending requests back to back."""
    while time.time() < stop:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            while time.time() < stop:
                writer.write(f"GET {path} HTTP/1.1\r\nHost: soak\r\n\r\n".encode())
                await writer.drain()
                head = await reader.readuntil(b"\r\n\r\n")
                status = head[9:12].decode()
                length = 0
                close = False
                for line in head.split(b"\r\n"):
                    low = line.lower()
                    if low.startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1].strip() or 0)
                    if low.startswith(b"connection:") and b"close" in low:
                        close = True
                if length:
                    await reader.readexactly(length)
                counts[status] = counts.get(status, 0) + 1
                if close:
                    break
            writer.close()
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            counts["error"] = counts.get("error", 0) + 1
            await asyncio.sleep(0.05)


async def slow_headers(port, stop, stats):
    """A slowloris client: one header byte at a time; counts how often tollgate cuts it."""
    while time.time() < stop:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /slow HTTP/1.1\r\nHost: soak\r\nX-Slow: ")
            await writer.drain()
            while time.time() < stop:
                writer.write(b"a")
                await writer.drain()
                await asyncio.sleep(1.0)
                if reader.at_eof():
                    break
            stats["slow_headers_cut"] = stats.get("slow_headers_cut", 0) + 1
            writer.close()
        except (ConnectionError, OSError):
            stats["slow_headers_cut"] = stats.get("slow_headers_cut", 0) + 1
            await asyncio.sleep(0.2)


async def slow_body(port, stop, stats):
    """A client that announces a body on the unlimited route and sends it very slowly."""
    while time.time() < stop:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /open HTTP/1.1\r\nHost: soak\r\nContent-Length: 100000\r\n\r\n")
            await writer.drain()
            while time.time() < stop and not reader.at_eof():
                writer.write(b"x")
                await writer.drain()
                await asyncio.sleep(2.0)
            writer.close()
            stats["slow_bodies"] = stats.get("slow_bodies", 0) + 1
        except (ConnectionError, OSError):
            stats["slow_bodies"] = stats.get("slow_bodies", 0) + 1
            await asyncio.sleep(0.2)


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


async def sample_rss(pids, stop, samples, every):
    while time.time() < stop:
        samples.append({"t": round(time.time(), 1), "rss_kib": [rss_kib(p) for p in pids]})
        await asyncio.sleep(every)


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--upstream-port", type=int, required=True)
    ap.add_argument("--ports", required=True, help="comma-separated tollgate ports")
    ap.add_argument("--pids", default="", help="comma-separated tollgate pids (else read from the .go file)")
    ap.add_argument("--seconds", type=int, default=180)
    ap.add_argument("--limit", type=int, required=True)
    ap.add_argument("--window", type=int, required=True)
    ap.add_argument("--flooders", type=int, default=32)
    ap.add_argument("--slow", type=int, default=100)
    ap.add_argument("--ready-file", required=True)
    args = ap.parse_args()

    upstream = Upstream()
    server = await asyncio.start_server(upstream.handle, "127.0.0.1", args.upstream_port)
    with open(args.ready_file, "w") as f:
        f.write("ready\n")
    # Give the caller a moment to start tollgate against the upstream.
    while not os.path.exists(args.ready_file + ".go"):
        await asyncio.sleep(0.1)

    ports = [int(p) for p in args.ports.split(",")]
    pids = [int(p) for p in args.pids.split(",")] if args.pids else []
    if not pids:
        with open(args.ready_file + ".go") as f:
            pids = [int(p) for p in f.read().split()]
    start = time.time()
    stop = start + args.seconds
    counts, stats, samples = {}, {}, []
    tasks = []
    for i in range(args.flooders):
        tasks.append(flood_client(ports[i % len(ports)], "/limited", stop, counts))
    for i in range(args.slow):
        port = ports[i % len(ports)]
        tasks.append(slow_headers(port, stop, stats) if i % 2 == 0 else slow_body(port, stop, stats))
    tasks.append(sample_rss(pids, stop, samples, 10))
    await asyncio.gather(*tasks)
    server.close()

    # Every epoch-aligned window must have let at most `limit` flood requests through.
    # (Slow-body requests go to the unlimited route and are few; they are excluded by
    # counting only arrivals during the flood, which all go to /limited.)
    per_window = {}
    for t in upstream.arrivals:
        w = int(t // args.window)
        per_window[w] = per_window.get(w, 0) + 1
    worst = max(per_window.values()) if per_window else 0
    first_rss = [s for s in samples[0]["rss_kib"]] if samples else []
    last_rss = [s for s in samples[-1]["rss_kib"]] if samples else []
    peak_rss = [max(s["rss_kib"][i] or 0 for s in samples) for i in range(len(pids))] if samples else []
    result = {
        "seconds": args.seconds,
        "instances": len(ports),
        "flood_responses": counts,
        "slow_clients": stats,
        "upstream_requests": len(upstream.arrivals),
        "windows": len(per_window),
        "worst_window": worst,
        "limit": args.limit,
        "limit_held": worst <= args.limit,
        "rss_kib_first": first_rss,
        "rss_kib_last": last_rss,
        "rss_kib_peak": peak_rss,
        "rss_samples": samples,
    }
    print(json.dumps(result, indent=1))
    return 0 if result["limit_held"] else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
