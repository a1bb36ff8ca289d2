#!/usr/bin/env bash
# Quick start, command 1: set up the environment if needed, then run the main job: GRPO on the toy shapes task
# (a tiny Qwen2-VL built offline, prompts made on the fly, rollouts through the real vLLM engine, on the CPU).
# Extra arguments are config overrides, e.g.
#   bash scripts/demo.sh data.generator_options.task=count      # another question about the image
#   bash scripts/demo.sh data.generator_options.blank=true      # the control: grey images stay near chance
#   bash scripts/demo.sh trainer.seed=3 rollout.seed=3          # another seed
set -eo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
model="$(python -m mmrlhf.testing.tiny_models qwen2_vl tiny 0)"
exec mmrlhf train examples/grpo_toy_shapes_cpu.yaml "model.pretrain=$model" trainer.overwrite_output_dir=true "$@"
