#!/usr/bin/env bash
# One prepared GPU session for issue 54 (docs/gpu.md, "What to run on a lent GPU: tensor parallelism and sharded
# scoring"). With 2+ GPUs and vLLM importable: the tensor-parallel engine tests (tests/launch/test_tensor_parallel.py:
# the engine's shards after a sync equal the trainer's, its log-probs the trainer's). Otherwise (the lent machines so
# far: one GPU, no vLLM) that stage says why it is skipped. Then the sharded scoring path at real shapes:
# bench_sharded_scoring.py (whole / FSDP2-sharded / sharded + offload reference, bf16) at Qwen2.5-VL-7B and 32B.
# Each stage has its own time cap; tables and logs go to $OUT (default ./outputs/gpu).
#   bash benchmarks/gpu_sharded_scoring.sh            (on the GPU machine, from the repository root)
#   STAGES="score7b" bash benchmarks/gpu_sharded_scoring.sh
set -uo pipefail
OUT="${OUT:-outputs/gpu}"
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"

stage() {  # name, cap in seconds, command...
  local name=$1 cap=$2; shift 2
  local t0=$SECONDS
  timeout "$cap" "$@" >"$OUT/$name.txt" 2>"$OUT/$name.err"
  local rc=$?
  echo "[gpu] $name: rc $rc in $((SECONDS - t0)) s (cap $cap)" | tee -a "$OUT/stages.txt"
  grep "^|\|^Reference\|passed\|failed\|skipped" "$OUT/$name.txt" | head -40
  [ $rc -eq 0 ] || tail -5 "$OUT/$name.err"
}

# STAGES picks stages (default all): tp score7b score32b
want() { [[ " ${STAGES:-tp score7b score32b} " == *" $1 "* ]]; }

GPUS=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if want tp; then
  if [ "$GPUS" -ge 2 ] && $PY -c "import vllm" 2>/dev/null; then
    stage tp "${CAP_TP:-300}" $PY -m pytest -q -p no:cacheprovider tests/launch/test_tensor_parallel.py
  else
    echo "[gpu] tp: skipped: $GPUS GPU(s), vLLM $($PY -c 'import vllm; print(vllm.__version__)' 2>/dev/null \
      || echo 'not importable'): the tensor-parallel engine check needs 2 GPUs and vLLM" | tee -a "$OUT/stages.txt"
  fi
fi
# the reference's scoring forwards, whole / sharded / sharded + offload, one GRPO group (one 448 px image, n = 8)
want score7b && stage score7b "${CAP_7B:-200}" $PY benchmarks/bench_sharded_scoring.py --shape qwen2_5_vl_7b \
  --json "$OUT/score7b.json"
# 32B: 62 GiB of bf16 weights, whole on one 80+ GiB GPU only for this measurement (a run shards it over its ranks)
want score32b && stage score32b "${CAP_32B:-300}" $PY benchmarks/bench_sharded_scoring.py --shape qwen2_5_vl_32b \
  --repeats 2 --json "$OUT/score32b.json"
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null || true
