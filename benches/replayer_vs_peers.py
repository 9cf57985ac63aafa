#!/usr/bin/env python3
"""Analysis for benches/replayer_vs_peers.sh (standard library only).

  replayer_vs_peers.py row TOOL RATE REP RUN_DIR   one JSON row on stdout
  replayer_vs_peers.py table ROWS.jsonl            the markdown table on stdout

RUN_DIR holds `server.jsonl` (the emulator's --request-log lines of this run) and the tool's
own output (`summary.json` + `records.jsonl` for cacheroute replay, `aiperf/` for aiperf,
`guidellm.json`, `vllm.json`). Server truth: TTFT = first_token_s - arrival_s, e2e = end_s -
arrival_s, achieved rate = (arrivals - 1) / (last arrival - first arrival).
"""

import json
import math
import os
import sys


def pct(xs, q):
    """The q-quantile (0..1) by linear interpolation; None for no data."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def server_side(path):
    lines = []
    with open(path) as f:
        for line in f:
            line = line.strip("\0 \n")
            if line:
                lines.append(json.loads(line))
    ok = [l for l in lines if l["status"] == 200 and l["complete"]]
    arr = sorted(l["arrival_s"] for l in lines)
    gaps = [b - a for a, b in zip(arr, arr[1:])]
    mean_gap = sum(gaps) / len(gaps) if gaps else None
    cv = None
    if gaps and mean_gap > 0:
        var = sum((g - mean_gap) ** 2 for g in gaps) / len(gaps)
        cv = math.sqrt(var) / mean_gap
    ttft = [l["first_token_s"] - l["arrival_s"] for l in ok if l["first_token_s"] is not None]
    e2e = [l["end_s"] - l["arrival_s"] for l in ok]
    return {
        "arrivals": len(lines),
        "errors": len(lines) - len(ok),
        "first_arrival": arr[0] if arr else None,
        "arrivals_sorted": arr,
        "rate": (len(arr) - 1) / (arr[-1] - arr[0]) if len(arr) > 1 else None,
        "cv": cv,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        "e2e_p50": pct(e2e, 0.5),
        "e2e_p99": pct(e2e, 0.99),
    }


def sorted_lag(intended_wall, arrivals):
    """Server arrival minus intended send time, pairing the i-th earliest of each."""
    a, b = sorted(intended_wall), arrivals
    n = min(len(a), len(b))
    if n == 0:
        return None, None
    lags = [b[i] - a[i] for i in range(n)]
    return pct(lags, 0.5), pct(lags, 0.99)


def tool_cacheroute(d, srv):
    s = json.load(open(os.path.join(d, "summary.json")))
    recs = [json.loads(l) for l in open(os.path.join(d, "records.jsonl"))]
    out = {
        "claimed_rate": s["achieved_qps"],
        "requests": s["requests"],
        "tool_errors": s["requests"] - s["ok"],
        "ttft_p50": s["ttft_p50_s"],
        "ttft_p99": s["ttft_p99_s"],
        "e2e_p50": s["e2e_p50_s"],
        "e2e_p99": s["e2e_p99_s"],
        "tool_lag_p50": s["lag_p50_s"],
        "tool_lag_p99": s["lag_p99_s"],
    }
    start = s.get("start_unix_s")
    if start is not None:
        sched = [start + r["scheduled_s"] for r in recs]
        out["srv_lag_p50"], out["srv_lag_p99"] = sorted_lag(sched, srv["arrivals_sorted"])
    return out


def tool_aiperf(d, srv):
    s = json.load(open(os.path.join(d, "aiperf", "profile_export_aiperf.json")))
    ms = 1e-3
    out = {
        "claimed_rate": s["request_throughput"]["avg"],
        "requests": s["request_count"]["avg"],
        "ttft_p50": s["time_to_first_token"]["p50"] * ms,
        "ttft_p99": s["time_to_first_token"]["p99"] * ms,
        "e2e_p50": s["request_latency"]["p50"] * ms,
        "e2e_p99": s["request_latency"]["p99"] * ms,
    }
    errs = s.get("error_request_count") or {}
    out["tool_errors"] = errs.get("avg", 0) if isinstance(errs, dict) else 0
    # Per request: the credit (the timing manager's go) and the worker's send, wall-clock ns.
    lags, issued = [], []
    path = os.path.join(d, "aiperf", "profile_export.jsonl")
    if os.path.exists(path):
        for line in open(path):
            m = json.loads(line).get("metadata", {})
            if m.get("benchmark_phase", "profiling") != "profiling":
                continue
            if m.get("credit_issued_ns") and m.get("request_start_ns"):
                lags.append((m["request_start_ns"] - m["credit_issued_ns"]) * 1e-9)
                issued.append(m["credit_issued_ns"] * 1e-9)
    out["tool_lag_p50"], out["tool_lag_p99"] = pct(lags, 0.5), pct(lags, 0.99)
    # aiperf exports when each credit was issued, not when it was due: a lower bound of lag.
    out["srv_lag_p50"], out["srv_lag_p99"] = sorted_lag(issued, srv["arrivals_sorted"])
    return out


def tool_guidellm(d, srv):
    s = json.load(open(os.path.join(d, "guidellm.json")))
    b = s["benchmarks"][0]
    m = b["metrics"]
    ok = b["requests"]["successful"]
    ttft = m["time_to_first_token_ms"]["successful"]["percentiles"]
    lat = m["request_latency"]["successful"]["percentiles"]
    total = m["request_totals"]
    out = {
        "claimed_rate": len(ok) / b["duration"] if b["duration"] else None,
        "requests": total.get("total"),
        "tool_errors": total.get("errored", 0) + total.get("incomplete", 0),
        "ttft_p50": ttft["p50"] * 1e-3,
        "ttft_p99": ttft["p99"] * 1e-3,
        "e2e_p50": lat["p50"],
        "e2e_p99": lat["p99"],
    }
    reqs = ok + b["requests"].get("errored", []) + b["requests"].get("incomplete", [])
    timings = [r["info"]["timings"] for r in reqs]
    lags = [
        t["request_start"] - t["targeted_start"]
        for t in timings
        if t.get("request_start") and t.get("targeted_start")
    ]
    out["tool_lag_p50"], out["tool_lag_p99"] = pct(lags, 0.5), pct(lags, 0.99)
    due = [t["targeted_start"] for t in timings if t.get("targeted_start")]
    out["srv_lag_p50"], out["srv_lag_p99"] = sorted_lag(due, srv["arrivals_sorted"])
    return out


def tool_vllm(d, srv):
    s = json.load(open(os.path.join(d, "vllm.json")))
    return {
        "claimed_rate": s["request_throughput"],
        "requests": s["completed"] + s["failed"],
        "tool_errors": s["failed"],
        "ttft_p50": s["p50_ttft_ms"] * 1e-3,
        "ttft_p99": s["p99_ttft_ms"] * 1e-3,
        "e2e_p50": s["p50_e2el_ms"] * 1e-3,
        "e2e_p99": s["p99_e2el_ms"] * 1e-3,
    }


TOOLS = {
    "cacheroute": tool_cacheroute,
    "aiperf": tool_aiperf,
    "guidellm": tool_guidellm,
    "vllm": tool_vllm,
}


def row(tool, rate, rep, d):
    srv = server_side(os.path.join(d, "server.jsonl"))
    r = {"tool": tool, "offered": float(rate), "rep": int(rep)}
    try:
        r.update(TOOLS[tool](d, srv))
    except (OSError, KeyError, ValueError, TypeError, IndexError) as e:
        r["tool_error"] = f"{type(e).__name__}: {e}"
    srv.pop("arrivals_sorted")
    r["server"] = srv
    return r


def ms(x):
    return "-" if x is None else f"{x * 1e3:.2f}"


def pair(tool, truth):
    """`tool / server (+difference)` in ms."""
    if tool is None or truth is None:
        return f"{ms(tool)} / {ms(truth)}"
    return f"{ms(tool)} / {ms(truth)} ({(tool - truth) * 1e3:+.2f})"


def table(rows):
    head = [
        "tool",
        "offered req/s",
        "run",
        "server req/s",
        "tool claims req/s",
        "server lines / errors",
        "tool requests / errors",
        "inter-arrival CV",
        "lag p50 / p99 ms (tool's own)",
        "arrival − due p50 / p99 ms (server)",
        "TTFT p50 ms tool / server (diff)",
        "TTFT p99 ms tool / server (diff)",
        "e2e p50 ms tool / server (diff)",
        "e2e p99 ms tool / server (diff)",
    ]
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    order = {t: i for i, t in enumerate(TOOLS)}
    for r in sorted(rows, key=lambda r: (order.get(r["tool"], 9), r["offered"], r["rep"])):
        s = r["server"]
        if "tool_error" in r:
            out.append(
                f"| {r['tool']} | {r['offered']:.0f} | {r['rep']} | "
                + (f"{s['rate']:.0f}" if s["rate"] else "-")
                + f" | no result: {r['tool_error']} |"
                + " |" * (len(head) - 5)
            )
            continue
        f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
        out.append(
            "| "
            + " | ".join(
                [
                    r["tool"],
                    f"{r['offered']:.0f}",
                    str(r["rep"]),
                    f(s["rate"], ".0f"),
                    f(r.get("claimed_rate"), ".0f"),
                    f"{s['arrivals']} / {s['errors']}",
                    f"{f(r.get('requests'), '.0f')} / {f(r.get('tool_errors'), '.0f')}",
                    f(s["cv"], ".2f"),
                    f"{ms(r.get('tool_lag_p50'))} / {ms(r.get('tool_lag_p99'))}",
                    f"{ms(r.get('srv_lag_p50'))} / {ms(r.get('srv_lag_p99'))}",
                    pair(r.get("ttft_p50"), s["ttft_p50"]),
                    pair(r.get("ttft_p99"), s["ttft_p99"]),
                    pair(r.get("e2e_p50"), s["e2e_p50"]),
                    pair(r.get("e2e_p99"), s["e2e_p99"]),
                ]
            )
            + " |"
        )
    return "\n".join(out)


def main(argv):
    if len(argv) == 6 and argv[1] == "row":
        print(json.dumps(row(argv[2], argv[3], argv[4], argv[5])))
    elif len(argv) == 3 and argv[1] == "table":
        rows = [json.loads(l) for l in open(argv[2]) if l.strip()]
        print(table(rows))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
