#!/usr/bin/env bash
# One prepared GPU session (a lent machine: torch present, no vLLM; wheels carried in .whl, docs/gpu.md): the trainer
# at Qwen2.5-VL-7B shape with trainer.compute_copy against autocast, then the token-budget split and gradient
# checkpointing at that shape, then LoRA r = 64 with a float32 and a bf16 base. Each stage has its own time cap;
# tables and logs go to $OUT (default ./outputs/gpu).
#   bash benchmarks/gpu_compute_copy.sh            (on the GPU machine, from the repository root)
#   STAGES="lora" bash benchmarks/gpu_compute_copy.sh
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
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"

stage() {  # name, cap in seconds, command...
  local name=$1 cap=$2; shift 2
  local t0=$SECONDS
  timeout "$cap" "$@" >"$OUT/$name.txt" 2>"$OUT/$name.err"
  local rc=$?
  echo "[gpu] $name: rc $rc in $((SECONDS - t0)) s (cap $cap)" | tee -a "$OUT/stages.txt"
  grep -v "^\s*$" "$OUT/$name.txt" | grep "^|\|x autocast\|vs best\|Trainer\|LoRA base" | head -60
  [ $rc -eq 0 ] || tail -5 "$OUT/$name.err"
}

# STAGES picks stages (default all): copy budget lora
want() { [[ " ${STAGES:-copy budget lora} " == *" $1 "* ]]; }

# 1. compute copy vs autocast: the packed and grouped rows (flex kernel), one image at 448 and 896 px
want copy && stage copy "${CAP_COPY:-270}" $PY benchmarks/bench_trainer.py --shape qwen2_5_vl_7b --groups img448,img896 \
  --layouts packed,grouped --kernels flex --copy off,on --repeats 3 --warmup 2 --json "$OUT/copy.json"
# 2. the token-budget split and gradient checkpointing at 7B, with and without the copy (the mixed step)
want budget && stage budget "${CAP_BUDGET:-230}" $PY benchmarks/bench_trainer.py --shape qwen2_5_vl_7b --groups mixed \
  --layouts packed --kernels flex --splits count,budget --checkpointing off,on --copy off,on --repeats 2 --warmup 1 \
  --json "$OUT/budget.json"
# 3. LoRA r = 64 with its frozen base in float32 and in bf16 (model.lora.base_dtype), with and without the copy
if want lora; then
  stage lora "${CAP_LORA:-300}" $PY benchmarks/bench_trainer.py --shape qwen2_5_vl_7b --groups img448,mixed \
    --layouts packed --kernels flex --copy off,on --lora 64 --lora-base float32,bfloat16 --repeats 3 --warmup 2 \
    --json "$OUT/lora.json"
fi
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null || true
