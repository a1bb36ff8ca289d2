#!/usr/bin/env bash
# Quick start, command 2: set up the environment if needed, then run the whole test suite (slow tests included).
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -m "not slow" tests/test_config.py
set -eo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
exec python -m pytest "$@"
