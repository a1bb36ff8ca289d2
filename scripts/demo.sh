#!/usr/bin/env bash
# Quick start, command 1: set up the environment if needed, then run the main job.
# For now the main job is the smoke run (tiny Qwen-VL -> vLLM generation with images and video -> log-prob check);
# extra arguments go to it, e.g.  bash scripts/demo.sh --family all
set -eo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
# vLLM on CPU warns at every step that it cannot change the thread count: keep the table readable.
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-ERROR}"
exec mmrlhf smoke "$@"
