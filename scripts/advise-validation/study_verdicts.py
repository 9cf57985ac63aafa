#!/usr/bin/env python3
"""Apply the verdict rule of docs/advise.md to a study's report JSON, for validation only: the
rule `cacheroute advise` applies to its own small study (analysis::advise::classify), applied
here to the measured studies it is checked against, on their own ladders and seeds (and to
their capacities as the report gives them: knees when the spec has `refine:`, else ladder
steps).

Usage: study_verdicts.py reports/<study>.json
Prints, per sweep point, affinity (best of sticky/chwbl) and cacheroute against flat-lb and
against the best reactive baseline (best of flat-lb/dualmap/preble)."""
import json
import math
import sys

# Two-sided 97.5% Student-t quantiles, df = 1..10.
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228]


MARGIN = 0.05


def t_interval(values):
    n = len(values)
    m = sum(values) / n
    if n == 1:
        return m, m
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    h = T975[n - 2] * sd / math.sqrt(n)
    return m - h, m + h


def cap_range(cap, first):
    if cap["censored"] == "right":
        return cap["qps"], math.inf
    if cap["censored"] == "left":
        return 0.0, first
    return cap["qps"], cap["qps"]


def classify(ladder, subj, base):
    """analysis::advise::classify: per seed the lowest and highest ratio the two capacities
    allow (a censored capacity is a bound); WIN when the t interval of the lowest ratios lies
    above 1 + MARGIN, LOSE when that of the highest lies below 1 - MARGIN, TIE otherwise."""
    s = {c["seed"]: c for c in subj["capacity_qps"][0]["per_seed"]}
    b = {c["seed"]: c for c in base["capacity_qps"][0]["per_seed"]}
    seeds = sorted(set(s) & set(b))
    if not seeds or all(s[x]["censored"] == "left" and b[x]["censored"] == "left" for x in seeds):
        return "no pass", None, None
    lows, highs = [], []
    for x in seeds:
        s_lo, s_hi = cap_range(s[x], ladder[0])
        b_lo, b_hi = cap_range(b[x], ladder[0])
        lows.append(s_lo / b_hi if math.isfinite(b_hi) and b_hi > 0 else 0.0)
        highs.append(s_hi / b_lo if math.isfinite(s_hi) and b_lo > 0 else math.inf)
    lo = max(0.0, t_interval(lows)[0])
    hi = t_interval(highs)[1] if all(math.isfinite(h) for h in highs) else math.inf
    if lo > 1 + MARGIN:
        v = "win"
    elif hi < 1 - MARGIN:
        v = "lose"
    else:
        v = "tie"
    mean = sum(lows) / len(lows)
    return v, (lo, hi), mean


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
                v, ci, mean = classify(ladder, subj, base)
                ratio = "" if ci is None else f"{mean:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}]"
                print(f"{sw or '-':>10}  {name} ({subj['policy']}) vs {bname} ({base['policy']}): "
                      f"{v.upper()} {ratio}")


if __name__ == "__main__":
    main(sys.argv[1])
