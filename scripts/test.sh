#!/usr/bin/env bash
# Quick start, command 2: set up the environment if needed, then run the whole test suite (slow tests included).
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -m "not slow" tests/test_config.py
#
# Two pytest workers (pytest-xdist), each taking whole test files (--dist loadfile: a file's module fixtures, such
# as a trained run or a Ray instance, are made once): on the 2-core machines the suite runs on, one process used 0.9
# of a core on average (it waits on the engines, ranks and actors it starts), two use both. Each worker runs OpenMP
# on its share of the cores (tests/conftest.py; at OpenMP's default of every core, two workers oversubscribe them
# and the learning tests ran 2-7x slower). The files are handed out
# longest first (tests/conftest.py orders them by tests/durations.json; --no-loadscope-reorder keeps that order
# rather than xdist's most-tests-first). MMRLHF_TEST_WORKERS sets the count (0: one process, no workers); a later -n
# in the arguments wins too. The slowest 25 tests are listed at the end of every run (where CI time goes; a later
# --durations wins; scripts/test_durations.py turns a --durations=0 run into tests/durations.json).
set -eo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
exec python -m pytest -n "${MMRLHF_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=25 "$@"
