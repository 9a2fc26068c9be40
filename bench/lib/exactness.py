"""Drives tollgate instances to the end of one bucket's budget and reports how exact it was.

    exactness.py --ports P1,P2,... --rate R [--stop-after S] [--quiet-for Q]

Sends GET / round robin over the instances on 127.0.0.1, about R requests per second in all
(16 keep-alive connections per instance), until no request was admitted for Q seconds after
the first denial, or S seconds in all. Prints one JSON object: admitted per instance and in all,
when the first denial came and the last admission, how many denials came before that last
admission (denied early: units were still left somewhere), and the longest stretch without an
admission inside that span.
"""
import argparse
import asyncio
import json
import time


async def one(reader, writer):
    writer.write(b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n")
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    length = 0
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    if length:
        await reader.readexactly(length)
    return status


async def worker(port, gap, log, state):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    next_at = time.monotonic()
    while not state["done"]:
        next_at += gap
        delay = next_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        status = await one(reader, writer)
        log.append((time.monotonic(), port, status))
    writer.close()


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ports", required=True)
    p.add_argument("--rate", type=float, default=3000)
    p.add_argument("--stop-after", type=float, default=60)
    p.add_argument("--quiet-for", type=float, default=3)
    a = p.parse_args()
    ports = [int(x) for x in a.ports.split(",")]
    conns = 16
    gap = conns * len(ports) / a.rate
    log, state = [], {"done": False}
    started = time.monotonic()
    tasks = [asyncio.create_task(worker(port, gap, log, state)) for port in ports for _ in range(conns)]
    while True:
        await asyncio.sleep(0.2)
        now = time.monotonic()
        denied = [t for t, _, s in log if s == 429]
        admitted = [t for t, _, s in log if s == 200]
        if denied and now - max(admitted or [started]) > a.quiet_for and now - denied[0] > a.quiet_for:
            break
        if now - started > a.stop_after:
            break
    state["done"] = True
    await asyncio.gather(*tasks, return_exceptions=True)
    admitted = sorted(t for t, _, s in log if s == 200)
    denied = sorted(t for t, _, s in log if s == 429)
    other = sum(1 for _, _, s in log if s not in (200, 429))
    first_denial = denied[0] if denied else None
    last_admission = admitted[-1] if admitted else None
    early = [t for t in denied if last_admission is not None and t < last_admission]
    span = sorted(t for t in admitted if first_denial is not None and t >= first_denial)
    gaps = [b - a_ for a_, b in zip(span, span[1:])]
    print(json.dumps({
        "admitted": len(admitted),
        "admitted_per_port": {str(p_): sum(1 for _, q, s in log if q == p_ and s == 200) for p_ in ports},
        "denied": len(denied),
        "other_statuses": other,
        "denied_early": len(early),
        "first_denial_s": None if first_denial is None else round(first_denial - started, 3),
        "last_admission_s": None if last_admission is None else round(last_admission - started, 3),
        "denied_early_for_s": round(last_admission - first_denial, 3) if early else 0.0,
        "longest_pause_after_first_denial_s": round(max(gaps), 3) if gaps else 0.0,
    }))


asyncio.run(main())
