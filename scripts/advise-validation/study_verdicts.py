#!/usr/bin/env python3
"""Apply the verdict rule of docs/advise.md to a study's report JSON, for validation only: the
rule `cacheroute advise` applies to its own small study (analysis::advise::classify), applied
here to the measured studies it is checked against, on their own ladders and seeds.

Usage: study_verdicts.py reports/<study>.json
Prints, per sweep point, affinity (best of sticky/chwbl) and cacheroute against flat-lb and
against the best reactive baseline (best of flat-lb/dualmap/preble)."""
import json
import math
import sys

# Two-sided 97.5% Student-t quantiles, df = 1..10.
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]


def step(ladder, cap):
    if cap["censored"] == "left" or cap["qps"] <= 0:
        return -1
    return max(i for i, q in enumerate(ladder) if q <= cap["qps"] * (1 + 1e-9))


def classify(ladder, subj, base):
    s = {c["seed"]: c for c in subj["capacity_qps"][0]["per_seed"]}
    b = {c["seed"]: c for c in base["capacity_qps"][0]["per_seed"]}
    seeds = sorted(set(s) & set(b))
    steps = [(step(ladder, s[x]), step(ladder, b[x])) for x in seeds]
    if all(a < 0 and c < 0 for a, c in steps):
        return "no pass", None, None
    d = sum(a - c for a, c in steps) / len(steps)
    ratios = [s[x]["qps"] / b[x]["qps"] for x in seeds if b[x]["censored"] != "left" and b[x]["qps"] > 0]
    ci = None
    if ratios:
        n = len(ratios)
        m = sum(ratios) / n
        if n == 1:
            ci = (m, m)
        else:
            sd = math.sqrt(sum((r - m) ** 2 for r in ratios) / (n - 1))
            h = T975[n - 2] * sd / math.sqrt(n)
            ci = (max(0.0, m - h), m + h)
    contains_one = ci is not None and ci[0] <= 1 <= ci[1]
    if abs(d) <= 1 or contains_one:
        v = "tie"
    elif d > 1 and (ci is None or ci[0] > 1):
        v = "win"
    elif d < -1 and (ci is None or ci[1] < 1):
        v = "lose"
    else:
        v = "tie"
    mean = sum(ratios) / len(ratios) if ratios else float("nan")
    return v, d, (mean, ci)


def best(arms, names):
    found = [a for a in arms if a["policy"] in names]
    return max(found, key=lambda a: (a["capacity_qps"][0]["mean"], a["served_kv_hit"]["mean"])) if found else None


def main(path):
    d = json.load(open(path))
    ladder = d["ladder_qps"]
    sweeps = sorted({p["sweep"] for p in d["policies"]})
    for sw in sweeps:
        arms = [p for p in d["policies"] if p["sweep"] == sw]
        by = {a["policy"]: a for a in arms}
        aff = best(arms, ["sticky", "chwbl"])
        react = best(arms, ["flat-lb", "dualmap", "preble"])
        for subj, name in [(aff, "affinity"), (by.get("cacheroute"), "cacheroute")]:
            if subj is None:
                continue
            for base, bname in [(by.get("flat-lb"), "flat-lb"), (react, "best reactive")]:
                if base is None:
                    continue
                v, dd, r = classify(ladder, subj, base)
                ratio = "" if r is None else f"{r[0]:.2f}x [{r[1][0]:.2f}, {r[1][1]:.2f}]"
                print(f"{sw or '-':>10}  {name} ({subj['policy']}) vs {bname} ({base['policy']}): "
                      f"{v.upper()} {ratio} {dd:+.1f} steps")


if __name__ == "__main__":
    main(sys.argv[1])
