#!/usr/bin/env python3
"""Write the "default CacheRoute against every baseline" variants of study specs (docs/studies.md):
every baseline, CacheRoute at its defaults and `cacheroute-paper`, no `planner:` values, 2 seeds.

    python3 scripts/defaults-table.py OUT_DIR experiments/flagship-70b-fp8.yaml ...
    for f in OUT_DIR/*.yaml; do cacheroute run "$f" --db defaults.db --out OUT_DIR/reports --quiet; done
"""
import os
import re
import sys

POLICIES = [
    "{ policy: flat-lb }",
    "{ policy: sticky }",
    "{ policy: chwbl }",
    "{ policy: dualmap }",
    "{ policy: preble }",
    "{ policy: cacheroute }",
    # Algorithm 1 as published (`cacheroute-paper`): P2C tail, outstanding requests, pinned sets,
    # engine-model estimates, no conversation memory.
    "{ policy: cacheroute, cold_tail: p2c, load: outstanding, bounded_sets: false, autotune: false, conversations: false }",
]


def variant(text: str, spec_dir: str) -> str:
    text = re.sub(r"^name: (.*)$", r"name: \1-defaults", text, count=1, flags=re.M)
    # A trace named relative to the spec's directory stays readable from OUT_DIR.
    text = re.sub(
        r"^(\s*trace: )(?!/)(\S+)$",
        lambda m: m.group(1) + os.path.abspath(os.path.join(spec_dir, m.group(2))),
        text,
        flags=re.M,
    )
    text = re.sub(r"^planner: .*\n", "", text, flags=re.M)
    block = "policies:\n" + "".join(f"  - {p}\n" for p in POLICIES)
    text = re.sub(r"^policies:\n(  - .*\n)+", block, text, flags=re.M)
    text = re.sub(r"^baselines: .*$", "baselines: [flat-lb, sticky, chwbl, dualmap, preble]", text, flags=re.M)
    return re.sub(r"^seeds: .*$", "seeds: 2", text, flags=re.M)


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for spec in sys.argv[2:]:
        with open(spec) as f:
            text = f.read()
        if "policies:\n" not in text:
            sys.exit(f"{spec}: no block `policies:` list to replace (write the variant by hand)")
        dest = os.path.join(out, os.path.basename(spec))
        with open(dest, "w") as f:
            f.write(variant(text, os.path.dirname(os.path.abspath(spec))))
        print(dest)


if __name__ == "__main__":
    main()
