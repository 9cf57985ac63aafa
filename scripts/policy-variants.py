#!/usr/bin/env python3
"""Write variants of study specs with another policy list (docs/cacheroute.md, docs/studies.md):

    POLICIES="preble|cacheroute|cacheroute, cold_tail: prefix" [REFINE=0.05] [SUFFIX=-v] \\
        python3 scripts/policy-variants.py OUT_DIR experiments/flagship-70b-fp8.yaml ...

POLICIES: the `{ policy: ... }` entries, separated by `|` (the variants' baseline is preble, which
must be among them); seeds: 2; a trace named relative to the spec stays readable from OUT_DIR;
`planner:` values are dropped (every policy at its defaults).
"""
import os, re, sys
POL = os.environ.get("POLICIES", "preble|sticky|cacheroute|cacheroute, cold_tail: prefix").split("|")
SUFFIX = os.environ.get("SUFFIX", "-v")
if len(sys.argv) < 3:
    sys.exit(__doc__)
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
for spec in sys.argv[2:]:
    t = open(spec).read()
    d = os.path.dirname(os.path.abspath(spec))
    t = re.sub(r"^name: (.*)$", lambda m: f"name: {m.group(1)}{SUFFIX}", t, count=1, flags=re.M)
    t = re.sub(r"^(\s*trace: )(?!/)(\S+)$", lambda m: m.group(1) + os.path.abspath(os.path.join(d, m.group(2))), t, flags=re.M)
    t = re.sub(r"^planner: .*\n", "", t, flags=re.M)
    t = re.sub(r"^policies:\n(  - .*\n)+", "policies:\n" + "".join(f"  - {{ policy: {p} }}\n" for p in POL), t, flags=re.M)
    t = re.sub(r"^baselines: .*$", "baselines: [preble]", t, flags=re.M)
    t = re.sub(r"^seeds: .*$", "seeds: 2", t, flags=re.M)
    if os.environ.get("REFINE"):
        t += f"refine: {os.environ['REFINE']}\n"
    p = os.path.join(out, os.path.basename(spec)); open(p, "w").write(t); print(p)
