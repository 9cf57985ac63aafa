#!/usr/bin/env python3
"""Reference: the paper's Algorithm 1 in plain single-threaded Python with heapq.

Used only to compare construction time with the Rust planner on the same input:
    python3 scripts/plan_heapq.py data/paper-rates.csv --destinations 30 --q-cap 6 --warm-slots 128
Prints admitted keys, max/mean expected load and the best/median construction time (ms) over
--repeat runs (file reading excluded, as in `cacheroute plan`'s build_ms).
"""
import argparse
import heapq
import math
import statistics
import time


def plan(rates, r, q_cap, w):
    order = sorted(range(len(rates)), key=lambda i: -rates[i][1])
    budget = r * w
    used = 0
    admitted = []
    admitted_rate = 0.0
    for i in order:
        rate = rates[i][1]
        if rate <= 0:
            continue
        k = min(r, max(1, math.ceil(rate / q_cap)))
        if used + k <= budget:
            used += k
            admitted.append((i, k))
            admitted_rate += rate
    total = sum(x[1] for x in rates)
    cold = (total - admitted_rate) / r
    heap = [(cold, d) for d in range(r)]
    heapq.heapify(heap)
    table = {}
    for i, k in admitted:
        share = rates[i][1] / k
        chosen = [heapq.heappop(heap) for _ in range(k)]
        table[rates[i][0]] = [d for _, d in chosen]
        for load, d in chosen:
            heapq.heappush(heap, (load + share, d))
    loads = [0.0] * r
    for load, d in heap:
        loads[d] = load
    return table, loads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rates")
    ap.add_argument("--destinations", type=int, default=30)
    ap.add_argument("--q-cap", type=float, default=6.0)
    ap.add_argument("--warm-slots", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    rates = []
    with open(a.rates) as f:
        next(f)
        for line in f:
            k, v = line.strip().split(",")[:2]
            rates.append((k, float(v)))
    times = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        table, loads = plan(rates, a.destinations, a.q_cap, a.warm_slots)
        times.append((time.perf_counter() - t0) * 1e3)
    mean = sum(loads) / len(loads)
    print(f"python heapq: {len(rates)} keys, admitted {len(table)}, max/mean {max(loads) / mean:.3f}")
    print(f"construction: best {min(times):.1f} ms, median {statistics.median(times):.1f} ms over {a.repeat} runs")


if __name__ == "__main__":
    main()
