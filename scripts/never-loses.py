#!/usr/bin/env python3
"""Does default CacheRoute ever lose to the best baseline? (capacity >= 0.95x the best baseline's,
e2e p99 at equal load <= 1.10x the best's, on every workload). Stdlib only.

    # 1. variant specs: the policy list replaced, `planner:` values dropped, 2 seeds, refine 0.05
    [POLICIES="flat-lb|sticky|chwbl|dualmap|preble|cacheroute"] [SUFFIX=-nl] [REFINE=0.05] \\
        python3 scripts/never-loses.py specs OUT_DIR experiments/longtail-clients-8b.yaml ...
    for f in OUT_DIR/*.yaml; do cacheroute run "$f" --db nl.db --out OUT_DIR/reports --quiet; done

    # 2. the paper workload through `cacheroute simulate --json` at 60, 100 and 150 req/s, 2 seeds
    #    (30 TP-2 70B destinations, 600 s); one JSON file per run, existing files kept
    [CACHEROUTE=cacheroute] [POLICIES=...] python3 scripts/never-loses.py paper SIM_DIR [--print]

    # 3. the tables (markdown): a results database (its reports are regenerated with
    #    `cacheroute report`, binary from $CACHEROUTE), or report JSON files or directories
    python3 scripts/never-loses.py table nl.db [OUT_DIR/reports ...] [--paper SIM_DIR]

POLICIES: `{ policy: ... }` entries separated by `|`; those whose name starts with `cacheroute`
are CacheRoute arms (the first is the one judged; in `table`, CR_LABEL names its report label
when it has parameters), the rest are the baselines.

Capacity is the report's (`capacity_qps`: highest passing ladder step, bisected to `refine`;
mean over seeds; censored values as the report stores them: `<first step` as 0, `>=last` as the
last step). The best baseline is the one with the highest mean capacity. "Equal load" is the
highest ladder step at which both CacheRoute and that baseline pass the SLO on every seed (above
it, one or both are past their knee and the p99s measure queue growth, not the routers); the
e2e p99 there is the report's mean over seeds. A row is a LOSS when the capacity ratio is below
0.95 or the p99 ratio above 1.10. A both-left-censored row (nobody passes the first step) is
a tie; a both-right-censored row (everybody passes every step) is a tie at the ladder's top.
"""
import glob
import json
import os
import re
import shlex
import sqlite3
import subprocess
import sys
import tempfile

DEFAULT_POLICIES = "flat-lb|sticky|chwbl|dualmap|preble|cacheroute"
CAP_MIN, P99_MAX = 0.95, 1.10
PAPER_LOADS = [60, 100, 150]
PAPER_SEEDS = [1, 2]
PAPER_ARGS = ["--workload", "paper", "--destinations", "30",
              "--engine", "llama-3.3-70b:h100:fp8:tp2", "--duration", "600"]


def policies():
    pol = [p.strip() for p in os.environ.get("POLICIES", DEFAULT_POLICIES).split("|") if p.strip()]
    name = lambda p: p.split(",")[0].strip()
    cr = [p for p in pol if name(p).startswith("cacheroute")]
    base = [p for p in pol if not name(p).startswith("cacheroute")]
    if not cr or not base:
        sys.exit("POLICIES needs a cacheroute entry and at least one baseline")
    return pol, cr, base


def drop_block(text, key):
    """Remove a top-level `key:` entry and its indented (or blank) continuation lines."""
    return re.sub(rf"^{key}:.*\n(?:(?:[ \t]+.*|[ \t]*)\n)*", "", text, flags=re.M)


def variant(text, spec_dir, pol, base):
    suffix = os.environ.get("SUFFIX", "-nl")
    text = re.sub(r"^name: (.*)$", lambda m: f"name: {m.group(1).strip()}{suffix}", text, count=1, flags=re.M)
    # Paths written in a spec are relative to it (docs/workloads.md): make them absolute so the
    # variant reads the same files from OUT_DIR (`trace:`, `arrivals.from`, a rates CSV `path:`).
    absolute = lambda m: m.group(1) + os.path.abspath(os.path.join(spec_dir, m.group(2)))
    text = "".join(
        line if line.lstrip().startswith("#")
        else re.sub(r"(\b(?:trace|from|path|inventory): )(?![/{\[])([^\s,}\]#]+)", absolute, line)
        for line in text.splitlines(keepends=True)
    )
    # Every policy at its defaults; the fields naming the original policies (and the notes on
    # their results) go with them.
    for key in ("planner", "reference", "paper", "claims", "notes", "baselines", "seeds", "refine",
                "policies"):
        text = drop_block(text, key)
    text = text.rstrip("\n") + "\n"
    text += "policies:\n" + "".join(f"  - {{ policy: {p} }}\n" for p in pol)
    text += "baselines: [" + ", ".join(p.split(",")[0].strip() for p in base) + "]\n"
    text += "seeds: 2\n"
    text += f"refine: {os.environ.get('REFINE', '0.05')}\n"
    return text


def cmd_specs(args):
    if len(args) < 2:
        sys.exit(__doc__)
    pol, _, base = policies()
    out = args[0]
    os.makedirs(out, exist_ok=True)
    for spec in args[1:]:
        with open(spec) as f:
            text = f.read()
        if not re.search(r"^policies:\n", text, flags=re.M):
            sys.exit(f"{spec}: no block `policies:` list to replace (write the variant by hand)")
        dest = os.path.join(out, os.path.basename(spec))
        with open(dest, "w") as f:
            f.write(variant(text, os.path.dirname(os.path.abspath(spec)), pol, base))
        print(dest)


def binary():
    return os.environ.get("CACHEROUTE", "cacheroute")


def slug(p):
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", p.strip("{} ")).strip("_")


def paper_runs(pol):
    for q in PAPER_LOADS:
        for s in PAPER_SEEDS:
            for p in pol:
                arg = p if "," not in p else "{policy: " + p + "}"
                yield q, s, p, [binary(), "simulate", *PAPER_ARGS, "--policy", arg,
                                "--qps", str(q), "--seed", str(s), "--json"]


def cmd_paper(args):
    if not args:
        sys.exit(__doc__)
    out, dry = args[0], "--print" in args[1:]
    pol, _, _ = policies()
    os.makedirs(out, exist_ok=True)
    for q, s, p, argv in paper_runs(pol):
        dest = os.path.join(out, f"{slug(p)}-q{q}-s{s}.json")
        line = " ".join(shlex.quote(a) for a in argv) + f" > {shlex.quote(dest)}"
        if dry:
            print(line)
            continue
        if os.path.exists(dest) and os.path.getsize(dest) > 0:
            continue
        print(line, file=sys.stderr, flush=True)
        with open(dest + ".part", "w") as f:
            subprocess.run(argv, stdout=f, stderr=subprocess.DEVNULL, check=True)
        os.replace(dest + ".part", dest)


def reports_from(paths):
    """Report JSONs from databases (regenerated with `cacheroute report`), files or directories."""
    for path in paths:
        if os.path.isdir(path):
            for f in sorted(glob.glob(os.path.join(path, "*.json"))):
                yield json.load(open(f))
        elif path.endswith(".json"):
            yield json.load(open(path))
        else:
            con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            names = [r[0] for r in con.execute("SELECT name FROM studies ORDER BY id")]
            con.close()
            with tempfile.TemporaryDirectory() as tmp:
                for n in names:
                    subprocess.run([binary(), "report", "--db", path, "--study", n, "--out", tmp],
                                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    yield json.load(open(os.path.join(tmp, f"{n}.json")))


def fmt_cap(c):
    m, cens = c["mean"], c["censored"]
    if m is None:
        return "n/a"
    s = f"{m:.1f}".removesuffix(".0")
    if cens == "right":
        return "≥" + s
    if cens == "left":
        return "<first"
    if cens == "mixed" or c.get("left_censored_seeds") or c.get("right_censored_seeds"):
        return s + "*"
    return s


def study_rows(rep, cr_names, base_names):
    """One row per (sweep point, SLO)."""
    rows = []
    by = {}
    for p in rep["policies"]:
        by.setdefault(p["sweep"], {})[p["label"].split(" [")[0]] = p
    for sweep, pols in by.items():
        cr = next((pols[n] for n in cr_names if n in pols), None)
        bases = [pols[n] for n in base_names if n in pols]
        if cr is None or not bases:
            continue
        for i, slo in enumerate(rep["slos"]):
            cap = lambda p: p["capacity_qps"][i]
            best = max(bases, key=lambda p: (cap(p)["mean"] or 0.0))
            cc, bc = cap(cr), cap(best)
            cm, bm = cc["mean"] or 0.0, bc["mean"] or 0.0
            if bm > 0:
                ratio = cm / bm
            else:  # the best baseline fails the first step on every seed
                ratio = float("inf") if cm > 0 else 1.0
            # Equal load: the highest ladder step both pass on every seed.
            def passes(p, j):
                ps = p["steps"][j].get("pass_share") or []
                return i < len(ps) and ps[i] is not None and ps[i] >= 1.0
            step = None
            for j in range(min(len(cr["steps"]), len(best["steps"]))):
                if passes(cr, j) and passes(best, j):
                    step = j
            if step is None:  # nobody passes: compare at the first step
                step = 0 if cr["steps"] and best["steps"] else None
            if step is not None:
                load = cr["steps"][step]["offered_qps"]
                cp = cr["steps"][step]["e2e_p99_s"]["mean"]
                bp = best["steps"][step]["e2e_p99_s"]["mean"]
                pr = cp / bp if cp is not None and bp else None
            else:
                load = cp = bp = pr = None
            loss = [w for w, bad in (("capacity", ratio < CAP_MIN),
                                     ("p99", pr is not None and pr > P99_MAX)) if bad]
            rows.append(dict(
                workload=rep["study"] + (f" [{sweep}]" if sweep else ""), slo=slo["label"],
                cr=fmt_cap(cc), cr_seeds="/".join(f"{s['qps']:.4g}" for s in cc["per_seed"]),
                best=best["label"].split(" [")[0], best_cap=fmt_cap(bc),
                best_seeds="/".join(f"{s['qps']:.4g}" for s in bc["per_seed"]),
                ratio=ratio, load=load, cp=cp, bp=bp, pr=pr, loss=loss,
                hit_cr=cr["served_kv_hit"]["mean"], hit_best=best["served_kv_hit"]["mean"]))
    return rows


def f2(x, d=2):
    return "n/a" if x is None else ("∞" if x == float("inf") else f"{x:.{d}f}")


def print_studies(paths, cr_names, base_names):
    print("| workload | SLO | CacheRoute capacity (per seed) | best baseline | its capacity (per seed) "
          "| ratio | equal load (req/s) | e2e p99 CR / best (s) | p99 ratio | hit CR / best | verdict |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | --- | ---: | --- | --- |")
    n = losses = 0
    for rep in reports_from(paths):
        for r in study_rows(rep, cr_names, base_names):
            n += 1
            losses += bool(r["loss"])
            print(f"| {r['workload']} | {r['slo']} | {r['cr']} ({r['cr_seeds']}) | {r['best']} "
                  f"| {r['best_cap']} ({r['best_seeds']}) | {f2(r['ratio'])} | {f2(r['load'], 0)} "
                  f"| {f2(r['cp'])} / {f2(r['bp'])} | {f2(r['pr'])} "
                  f"| {100 * (r['hit_cr'] or 0):.0f}% / {100 * (r['hit_best'] or 0):.0f}% "
                  f"| {'**LOSS** (' + ', '.join(r['loss']) + ')' if r['loss'] else 'ok'} |")
    print(f"\n{n} rows, {losses} LOSS (capacity ratio < {CAP_MIN} or p99 ratio > {P99_MAX}).")


def print_paper(sim_dir, pol, cr_names, base_names):
    data = {}
    for q, s, p, _ in paper_runs(pol):
        f = os.path.join(sim_dir, f"{slug(p)}-q{q}-s{s}.json")
        if os.path.exists(f) and os.path.getsize(f) > 0:
            data.setdefault((q, p), []).append(json.load(open(f))["summary"])
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    print("\n`cacheroute simulate --workload paper --destinations 30 --engine "
          "llama-3.3-70b:h100:fp8:tp2 --duration 600` (warm-up 60 s), mean over seeds "
          f"{', '.join(map(str, PAPER_SEEDS))}:\n")
    print("| req/s | policy | e2e p99 (s) per seed | mean | served hit | completed/offered |")
    print("| ---: | --- | --- | ---: | ---: | ---: |")
    verdicts = []
    for q in PAPER_LOADS:
        row = {}
        for p in pol:
            runs = data.get((q, p), [])
            if not runs:
                continue
            p99 = mean([r["e2e_p99_s"] for r in runs])
            hit = mean([r["served_kv_hit"] for r in runs])
            row[p] = (p99, hit)
            done = mean([r["throughput_qps"] / r["offered_qps"] for r in runs if r.get("offered_qps")])
            per_seed = " / ".join("%.2f" % r["e2e_p99_s"] for r in runs)
            print(f"| {q} | {p} | {per_seed} | {p99:.2f} "
                  f"| {100 * hit:.1f}% | {f2(done)} |")
        cr = next((p for p in cr_names if p in row), None)
        bases = [p for p in base_names if p in row]
        if cr and bases:
            best = min(bases, key=lambda p: row[p][0])
            r = row[cr][0] / row[best][0]
            verdicts.append(f"| {q} | {row[cr][0]:.2f} | {best} | {row[best][0]:.2f} | {r:.2f} "
                            f"| {100 * row[cr][1]:.1f}% / {100 * row[best][1]:.1f}% "
                            f"| {'**LOSS**' if r > P99_MAX else 'ok'} |")
    print("\n| req/s | CacheRoute e2e p99 (s) | best baseline (lowest p99) | its p99 (s) | ratio "
          "| hit CR / best | verdict |")
    print("| ---: | ---: | --- | ---: | ---: | --- | --- |")
    print("\n".join(verdicts))


def cmd_table(args):
    sim = None
    if "--paper" in args:
        k = args.index("--paper")
        sim = args[k + 1]
        args = args[:k] + args[k + 2:]
    pol, cr, base = policies()
    cr_names = [p.split(",")[0].strip() for p in cr]
    base_names = [p.split(",")[0].strip() for p in base]
    if args:
        # A CacheRoute arm with parameters has another report label: CR_LABEL names it.
        print_studies(args, [os.environ.get("CR_LABEL", cr_names[0])], base_names)
    if sim:
        print_paper(sim, pol, cr[:1], base)


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in ("specs", "paper", "table"):
        sys.exit(__doc__)
    {"specs": cmd_specs, "paper": cmd_paper, "table": cmd_table}[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
