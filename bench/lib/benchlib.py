#!/usr/bin/env python3
"""Helpers for bench/run.sh: parse load-tool output, sample /proc, summarise runs.

Subcommands (all output goes to stdout):
  parse-wrk FILE              -> rps p50_us p99_us requests non2xx errors   (tab-separated)
  parse-h2load FILE LOGFILE   -> same fields; percentiles from h2load --log-file
  count FILE                  -> completed requests of a wrk or h2load output (warm-ups)
  cpu-snap                    -> per-CPU "busy:total" jiffies, comma-separated
  cpu-busy SNAP0 SNAP1        -> per-CPU busy percent between two snaps, e.g. "98/64"
  rss PID                     -> VmRSS in KiB of PID plus its descendants (nginx: master+worker)
  metric URL NAME...          -> for each metric NAME, the sum over its label sets, from a
                                 Prometheus text page (loopback URL only)
  summarize TSV [SOAK_JSON]   -> markdown: the results table and the targets
"""
import ipaddress
import json
import os
import re
import statistics
import sys
import urllib.parse
import urllib.request
from collections import OrderedDict

UNIT_US = {"us": 1.0, "ms": 1e3, "s": 1e6, "m": 60e6}


def us(txt):
    m = re.fullmatch(r"([0-9.]+)(us|ms|s|m)", txt.strip())
    if not m:
        raise SystemExit(f"bad latency {txt!r}")
    return float(m.group(1)) * UNIT_US[m.group(2)]


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def parse_wrk(path):
    t = read(path)
    rps = re.search(r"^Requests/sec:\s+([0-9.]+)", t, re.M)
    p50 = re.search(r"^\s+50%\s+(\S+)", t, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", t, re.M)
    n = re.search(r"^\s+(\d+) requests in", t, re.M)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", t)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", t)
    if not (rps and n):
        raise SystemExit(f"cannot parse wrk output {path}")
    errs = sum(int(x) for x in sock.groups()) if sock else 0
    return [
        f"{float(rps.group(1)):.0f}",
        f"{us(p50.group(1)):.0f}" if p50 else "NA",
        f"{us(p99.group(1)):.0f}" if p99 else "NA",
        n.group(1),
        non2xx.group(1) if non2xx else "0",
        str(errs),
    ]


def h2load_counts(t, path):
    st = re.search(
        r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored", t
    )
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", t)
    if not (st and codes):
        raise SystemExit(f"cannot parse h2load output {path}")
    done, ok, failed, errored = (int(x) for x in st.groups())
    non2xx = sum(int(x) for x in codes.groups()[1:])
    # h2load counts a 4xx/5xx answer as "failed" too: errors are what has no status at all
    return done, non2xx, max(0, failed + errored - sum(int(x) for x in codes.groups()[2:]))


def parse_h2load(path, log):
    t = read(path)
    rps = re.search(r"finished in [^,]+, ([0-9.]+) req/s", t)
    if not rps:
        raise SystemExit(f"cannot parse h2load output {path}")
    done, non2xx, errs = h2load_counts(t, path)
    lat = []
    with open(log, encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split("\t")
            if len(parts) >= 3:
                try:
                    lat.append(int(parts[2]))
                except ValueError:
                    pass
    lat.sort()

    def pct(p):
        if not lat:
            return "NA"
        return str(lat[min(len(lat) - 1, int(p / 100 * len(lat)))])

    return [f"{float(rps.group(1)):.0f}", pct(50), pct(99), str(done), str(non2xx), str(errs)]


def count(path):
    t = read(path)
    n = re.search(r"^\s+(\d+) requests in", t, re.M)
    if n:
        return int(n.group(1))
    return h2load_counts(t, path)[0]


def cpu_snap():
    out = []
    for line in read("/proc/stat").splitlines()[1:]:
        if not (line.startswith("cpu") and line[3].isdigit()):
            break
        v = [int(x) for x in line.split()[1:9]]
        total = sum(v)
        out.append(f"{total - v[3] - v[4]}:{total}")
    return ",".join(out)


def cpu_busy(a, b):
    res = []
    for x, y in zip(a.split(","), b.split(",")):
        b0, t0 = (int(v) for v in x.split(":"))
        b1, t1 = (int(v) for v in y.split(":"))
        res.append(f"{100 * (b1 - b0) / max(t1 - t0, 1):.0f}")
    return "/".join(res)


def rss(pid):
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(read(f"/proc/{d}/stat").rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            m = re.search(r"^VmRSS:\s+(\d+) kB", read(f"/proc/{p}/status"), re.M)
        except OSError:
            continue
        total += int(m.group(1)) if m else 0
        todo.extend(kids.get(p, []))
    return total


def metric(url, names):
    host = urllib.parse.urlsplit(url).hostname or ""
    if not ipaddress.ip_address(host).is_loopback:
        raise SystemExit("metric: loopback URLs only")
    try:
        text = urllib.request.urlopen(url, timeout=3).read().decode()
    except OSError:
        return ["NA"] * len(names)
    out = []
    for name in names:
        total, seen = 0.0, False
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)", line)
            if m:
                total += float(m.group(1))
                seen = True
        out.append(f"{total:.0f}" if seen else "NA")
    return out


# ---------------------------------------------------------------- summary
def med(xs):
    return statistics.median(xs) if xs else None


def fnum(x, fmt="{:,.0f}"):
    return "–" if x is None else fmt.format(x)


def read_tsv(path):
    with open(path, encoding="utf-8") as f:
        head = f.readline().rstrip("\n").split("\t")
        return [dict(zip(head, l.rstrip("\n").split("\t"))) for l in f if l.strip()]


def num(r, k):
    v = r.get(k, "NA")
    return None if v in ("NA", "", None) else float(v)


# A sliding-window mode and the fixed-window mode it is the same as otherwise (contract §3a).
SLIDING_OF = OrderedDict([
    ("tollgate-pg-hot-sliding", "tollgate-pg-hot"),
    ("tollgate-pg-10k-sliding", "tollgate-pg-10k"),
])
# What issue 18 asks of them: at least this × their fixed-window mode, in the same run.
SLIDING_TARGET = 0.9

# Issue 49's targets for reserved shares (contract §3c): each reserve mode against its memory
# reference (req/s ratio, p99 at most P99_OF × the reference's), and the mode without shares it
# is compared with for rows written.
RESERVE_OF = OrderedDict([
    ("tollgate-pg-hot-reserve", ("tollgate-memory", 0.95, "tollgate-pg-hot")),
    ("tollgate-pg-10k-reserve", ("tollgate-memory-10k", 0.9, "tollgate-pg-10k")),
])
RESERVE_P99_OF = 1.2
# At most this many statements per 1,000 decisions on the hot key, and this share of the rows
# the mode without shares writes on 10k keys.
RESERVE_HOT_STATEMENTS = 2.0
RESERVE_ROWS_SHARE = 0.2


def summarize(tsv, soak=None):
    rows = read_tsv(tsv)
    order = list(OrderedDict.fromkeys(r["target"] for r in rows))
    groups = OrderedDict()
    for r in rows:
        groups.setdefault((r["proto"], int(r["conns"])), OrderedDict()).setdefault(r["target"], []).append(r)
    out = []
    out.append(
        "| target | mode | conns | proto | req/s | p50 ms | p99 ms | × nginx | × tollgate-memory "
        "| non-2xx | DB stmts / 1k req | rows written / 1k req | store calls / 1k req | RSS MiB | CPU0/CPU1 busy % | n |"
    )
    out.append("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    stats = {}
    for (proto, conns), targets in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        per_rep = {t: {r["rep"]: num(r, "rps") for r in rs} for t, rs in targets.items()}

        def ratio(t, ref):
            if ref not in per_rep or t not in per_rep:
                return None
            xs = [v / per_rep[ref][rep] for rep, v in per_rep[t].items()
                  if v and per_rep[ref].get(rep)]
            return med(xs)

        for t in order:
            if t not in targets:
                continue
            rs = targets[t]
            rps = med([num(r, "rps") for r in rs if num(r, "rps") is not None])
            p50 = med([num(r, "p50_us") for r in rs if num(r, "p50_us") is not None])
            p99 = med([num(r, "p99_us") for r in rs if num(r, "p99_us") is not None])
            non2xx = sum(int(r["non2xx"]) + int(r["errors"]) for r in rs)

            def per_k(field):
                xs = []
                for r in rs:
                    v, n = num(r, field), (num(r, "requests") or 0) + (num(r, "warm_requests") or 0)
                    if v is not None and n:
                        xs.append(1000 * v / n)
                return med(xs)

            stm, rows_w, calls = per_k("db_stmts"), per_k("db_rows"), per_k("store_calls")
            rss_kib = med([num(r, "rss_kib") for r in rs if num(r, "rss_kib") is not None])
            busy = [r["cpu_busy"].split("/") for r in rs if r.get("cpu_busy", "NA") != "NA"]
            busy_s = "/".join(f"{med([float(b[i]) for b in busy]):.0f}" for i in range(len(busy[0]))) if busy else "–"
            xn, xm = ratio(t, "nginx"), ratio(t, "tollgate-memory")
            stats[(proto, conns, t)] = dict(rps=rps, p99=p99, xn=xn, xm=xm, stm=stm, calls=calls, rows=rows_w,
                                            xref=ratio(t, RESERVE_OF[t][0]) if t in RESERVE_OF else None,
                                            rx10k=ratio(t, "tollgate-memory-10k"), non2xx=non2xx,
                                            # median over rounds of sliding / fixed in one round
                                            rfixed=ratio(t, SLIDING_OF[t]) if t in SLIDING_OF else None)
            if t.startswith("tollgate-") and "base-" + t.split("-", 1)[1] in per_rep:
                # this build / BASE_BIN, round by round (run.sh BASE_BIN)
                b = "base-" + t.split("-", 1)[1]
                stats[(proto, conns, t)]["vsbase"] = sorted(
                    v / per_rep[b][rep] for rep, v in per_rep[t].items() if v and per_rep[b].get(rep))
            named = {"nginx": ("nginx", "proxy_pass"), "ceiling": ("hyper ceiling", "inline upstream")}
            kind = "tollgate (BASE_BIN)" if t.startswith("base-") else "tollgate"
            target, mode = named[t] if t in named else (kind, t.split("-", 1)[1])
            out.append(
                f"| {target} | {mode} | {conns} | {proto} | {fnum(rps)} | {fnum(p50 and p50 / 1000, '{:.2f}')} "
                f"| {fnum(p99 and p99 / 1000, '{:.2f}')} | {fnum(xn, '{:.2f}')} | {fnum(xm, '{:.2f}')} | {non2xx} "
                f"| {fnum(stm, '{:.2f}')} | {fnum(rows_w, '{:.2f}')} | {fnum(calls, '{:.2f}')} "
                f"| {fnum(rss_kib and rss_kib / 1024, '{:.1f}')} | {busy_s} | {len(rs)} |"
            )
    out.append("")
    out.append(targets_table(stats, groups, soak))
    return "\n".join(out)


def verdict(ok):
    return "–" if ok is None else ("met" if ok else "**not met**")


def targets_table(stats, groups, soak):
    out = ["| target | proto | conns | measured | verdict |", "|---|---|---:|---|---|"]
    for proto, conns in sorted(groups):
        g = lambda t: stats.get((proto, conns, t))  # noqa: E731
        mem, ngx = g("tollgate-memory"), g("nginx")
        if mem and ngx and mem["xn"] is not None:
            ok = mem["xn"] >= 1.0 and mem["p99"] is not None and ngx["p99"] is not None and mem["p99"] <= ngx["p99"]
            out.append(f"| memory ≥ nginx req/s, p99 no worse | {proto} | {conns} | "
                       f"{mem['xn']:.2f} × nginx; p99 {fnum(mem['p99'] and mem['p99'] / 1000, '{:.2f}')} vs "
                       f"{fnum(ngx['p99'] and ngx['p99'] / 1000, '{:.2f}')} ms | {verdict(ok)} |")
        # What hyper itself reaches in this run (bench/ceiling): each tollgate miss reads against it.
        ceil = g("ceiling")
        if ceil and ceil["xn"] is not None:
            gap = "; ".join(f"{m} {g('tollgate-' + m)['xn']:.2f}" for m in ("memory", "nolimit")
                            if g("tollgate-" + m) and g("tollgate-" + m)["xn"] is not None)
            out.append(f"| hyper-inline ceiling (bench/ceiling), for reference | {proto} | {conns} | "
                       f"{ceil['xn']:.2f} × nginx{'; tollgate ' + gap if gap else ''} | – |")
        hot = g("tollgate-pg-hot")
        if hot and hot["xm"] is not None:
            out.append(f"| Postgres hot key ≥ 0.8 × memory | {proto} | {conns} | {hot['xm']:.2f} × memory | {verdict(hot['xm'] >= 0.8)} |")
        k10 = g("tollgate-pg-10k")
        if k10 and k10["xm"] is not None:
            extra = f" ({k10['rx10k']:.2f} × memory with the same 10k-key wrk script)" if k10["rx10k"] is not None else ""
            out.append(f"| Postgres 10k keys ≥ 0.5 × memory | {proto} | {conns} | {k10['xm']:.2f} × memory{extra} | {verdict(k10['xm'] >= 0.5)} |")
        fl = g("tollgate-pg-flood")
        if fl and fl["xm"] is not None:
            ok_s = None if fl["stm"] is None else fl["stm"] < 1.0
            out.append(f"| flooded key: < 1 DB statement per 1,000 denied | {proto} | {conns} | "
                       f"{fnum(fl['stm'], '{:.2f}')} per 1,000 | {verdict(ok_s)} |")
            out.append(f"| flooded key: same req/s as memory (read as ≥ 0.95 ×) | {proto} | {conns} | "
                       f"{fl['xm']:.2f} × memory | {verdict(fl['xm'] >= 0.95)} |")
        # Only with BASE_BIN: this build against the other one, paired by round.
        for (p, c, t), st in stats.items():
            if (p, c) == (proto, conns) and st.get("vsbase"):
                xs = st["vsbase"]
                out.append(f"| this build / BASE_BIN: {t.split('-', 1)[1]} | {proto} | {conns} | "
                           f"{med(xs):.3f} (median of {len(xs)} same-round ratios; "
                           f"{', '.join(f'{x:.2f}' for x in xs)}) | – |")
        out.extend(reserve_targets(g, proto, conns))
        # Only when a sliding mode and its fixed mode both ran, in the same rounds of this run.
        for sliding, fixed in SLIDING_OF.items():
            sl = g(sliding)
            if sl and sl["rfixed"] is not None:
                out.append(f"| sliding / fixed: {sliding.split('-', 1)[1]} ≥ {SLIDING_TARGET} × "
                           f"{fixed.split('-', 1)[1]} | {proto} | {conns} | {sl['rfixed']:.2f} × "
                           f"{fixed.split('-', 1)[1]} (median of same-round ratios) | "
                           f"{verdict(sl['rfixed'] >= SLIDING_TARGET)} |")
    if soak:
        s = json.load(open(soak))
        open_ = [x["rss_kib"] for x in s["samples"] if x["phase"] != "start"]
        if open_:
            mx = max(open_) / 1024
            growth = (open_[-1] - open_[0]) / 1024
            out.append(
                f"| RSS < 64 MiB with {s['connections_open']} keep-alive connections, flat over "
                f"{s['soak_seconds']} s | h1 | {s['connections']} | start {s['samples'][0]['rss_kib'] / 1024:.1f} MiB, "
                f"with connections open min {min(open_) / 1024:.1f} / max {mx:.1f} MiB, last − first {growth:+.1f} MiB | "
                f"{verdict(mx < 64 and s['connections_open'] >= s['connections'])} (flatness: read the samples) |"
            )
    return "\n".join(out)


def reserve_targets(g, proto, conns):
    """Issue 49's lines for each reserve mode that ran with its references in this run."""
    out = []
    for t, (ref, want, plain) in RESERVE_OF.items():
        st, rf, pl = g(t), g(ref), g(plain)
        mode = t.split("-", 1)[1]
        if not st:
            continue
        if st["xref"] is not None:
            out.append(f"| {mode} ≥ {want} × {ref.split('-', 1)[1]} | {proto} | {conns} | "
                       f"{st['xref']:.2f} × (median of same-round ratios) | {verdict(st['xref'] >= want)} |")
        if rf and st["p99"] is not None and rf["p99"]:
            ratio = st["p99"] / rf["p99"]
            out.append(f"| {mode} p99 ≤ {RESERVE_P99_OF} × {ref.split('-', 1)[1]}'s | {proto} | {conns} | "
                       f"{st['p99'] / 1000:.2f} against {rf['p99'] / 1000:.2f} ms ({ratio:.2f} ×) | "
                       f"{verdict(ratio <= RESERVE_P99_OF)} |")
        if "hot" in mode and st["stm"] is not None:
            out.append(f"| {mode}: ≤ {RESERVE_HOT_STATEMENTS:g} DB statements per 1,000 | {proto} | {conns} | "
                       f"{st['stm']:.2f} per 1,000 | {verdict(st['stm'] <= RESERVE_HOT_STATEMENTS)} |")
        if "10k" in mode and pl and st["rows"] is not None and pl["rows"]:
            share = st["rows"] / pl["rows"]
            out.append(f"| {mode}: rows written ≤ {RESERVE_ROWS_SHARE:g} × {plain.split('-', 1)[1]}'s | {proto} | "
                       f"{conns} | {st['rows']:.1f} against {pl['rows']:.1f} per 1,000 ({share:.2f} ×) | "
                       f"{verdict(share <= RESERVE_ROWS_SHARE)} |")
    return out


def main():
    a = sys.argv[1:]
    if not a:
        raise SystemExit(__doc__)
    cmd = a[0]
    if cmd == "parse-wrk":
        print("\t".join(parse_wrk(a[1])))
    elif cmd == "parse-h2load":
        print("\t".join(parse_h2load(a[1], a[2])))
    elif cmd == "count":
        print(count(a[1]))
    elif cmd == "cpu-snap":
        print(cpu_snap())
    elif cmd == "cpu-busy":
        print(cpu_busy(a[1], a[2]))
    elif cmd == "rss":
        print(rss(int(a[1])))
    elif cmd == "metric":
        print("\t".join(metric(a[1], a[2:])))
    elif cmd == "summarize":
        print(summarize(a[1], a[2] if len(a) > 2 and os.path.exists(a[2]) else None))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
