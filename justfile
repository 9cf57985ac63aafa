# Mirrors the README's commands for people who use `just` (pip install rust-just).
# Nothing here is needed: every recipe is one plain command.

# The main job on the embedded default.
demo:
    cargo run --release -- plan --rates data/paper-rates.csv --destinations 30 --q-cap 6 --warm-slots 128

# The whole test suite (what CI runs, minus fmt and clippy).
test:
    bash scripts/test.sh

# What CI runs.
ci:
    bash .ci/run

# Criterion benchmarks (release).
bench:
    cargo bench

# Plan churn under drift on the paper-shaped workload.
churn:
    cargo run --release -- churn
