# Mirrors the README's commands for people who use `just` (pip install rust-just).
# Nothing here is needed: every recipe is one plain command.

# The main job on the embedded default.
demo:
    cargo run --release -- demo

# Every study of the paper in simulation (results.db, reports/).
studies:
    bash scripts/run-studies.sh

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
