#!/usr/bin/env bash
# The whole test suite: what the README's test command runs and what CI runs.
# Installs anything the tests need that a fresh machine lacks (idempotent), then runs cargo test.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --locked "$@"
