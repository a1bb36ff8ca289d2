"""Helpers for the judge tests: a tiny judge whose verdicts are known by construction, and a ``vllm serve``
subprocess (free port, logs kept in a file and shown on failure).

(A uniquely named module, not conftest.py, as reward_testing.py.)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


HINT_TURN = "<|im_start|>system\n{{ judge_hint }}<|im_end|>\n"
"""What the keyword judge's template adds when the ``judge_hint`` template variable is set."""
VLLM_START_TIMEOUT_S = 240.0  # a CPU vLLM server on a loaded 2-core machine takes 40 s or more to start


def build_keyword_judge(src: Path, out: Path, *, good: str, bad: str, gain: float = 20.0) -> Path:
    """A copy of the tiny Qwen2-VL at ``src`` whose first generated token is ``yes`` when the prompt holds more
    ``good`` word tokens than ``bad`` ones, ``no`` when fewer, and an even split when as many; every other token
    is far less likely, so the verdict pair is always among the top log-probs.

    How: the embeddings get three clean coordinates: ``c`` (1 for every token: a constant), ``k`` (+1 for ``good``,
    -1 for ``bad``, with and without a leading space) and ``j`` (0: the output slot). Layer 0's attention is made
    uniform over the prefix (query and key projections zeroed) and copies the mean of coordinate ``k`` into ``j``
    through one value / output slot; every other attention and MLP output is zeroed, so the last position's hidden
    state is its own embedding plus ``gain * mean(k)`` in ``j``. The LM head reads ``j`` with + for ``yes`` and - for
    ``no``, and gives every other token ``-10 * c``.
    """
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    sd = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    c, k, j = 0, 1, 2
    emb = sd["model.embed_tokens.weight"]
    emb[:, [c, k, j]] = 0.0
    emb[:, c] = 1.0
    for word, sign in ((good, 1.0), (bad, -1.0)):
        for variant in (word, " " + word):
            ids = tok.encode(variant, add_special_tokens=False)
            assert len(ids) == 1, f"{variant!r} is not one token of the tiny tokenizer: {ids}"
            emb[ids[0], k] = sign
    layers = sorted({int(name.split(".")[2]) for name in sd if name.startswith("model.layers.")})
    for layer in layers:
        pre = f"model.layers.{layer}."
        sd[pre + "self_attn.o_proj.weight"].zero_()
        sd[pre + "mlp.down_proj.weight"].zero_()
    attn = "model.layers.0.self_attn."
    for name in ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
        sd[attn + name].zero_()
    sd[attn + "v_proj.weight"][0, k] = 1.0  # kv head 0, slot 0 <- coordinate k
    sd[attn + "o_proj.weight"][j, 0] = gain  # query head 0 (reads kv head 0), slot 0 -> coordinate j
    head = sd["lm_head.weight"]
    head.zero_()
    head[:, c] = -10.0
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    head[yes, c], head[no, c] = 0.0, 0.0
    head[yes, j], head[no, j] = 1.0, -1.0
    save_file({name: v.contiguous() for name, v in sd.items()}, out / "model.safetensors", metadata={"format": "pt"})
    # A chat-template variable the tests set through the judge's chat_template_kwargs: its text enters the prompt
    # (and so the verdict) only when given.
    template = out / "chat_template.jinja"
    text = template.read_text()
    hook = "{% if add_generation_prompt %}"
    assert hook in text, f"the tiny chat template changed: no {hook!r} to hook the judge_hint variable before"
    template.write_text(text.replace(hook, "{% if judge_hint is defined %}" + HINT_TURN + "{% endif %}" + hook, 1))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """``vllm serve`` (through its module: the CPU build's ``vllm`` script cannot read its own version) on a free
    port of 127.0.0.1; ``base_url`` ends in ``/v1``. Its log is a file, kept on failure (``log_tail``)."""

    def __init__(self, model: Path, *, name: str, log_dir: Path, max_model_len: int = 2048) -> None:
        import httpx

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_dir / f"vllm-serve-{self.port}.log"
        self._log = open(self.log_path, "w")
        env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", PYTHONUNBUFFERED="1")
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                "--served-model-name", name, "--host", "127.0.0.1", "--port", str(self.port),
                "--max-model-len", str(max_model_len), "--enforce-eager", "--dtype", "float32",
                "--max-num-seqs", "8", "--limit-mm-per-prompt", '{"image": 2}']
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + VLLM_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; log {self.log_path}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/models", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vllm serve did not answer in {VLLM_START_TIMEOUT_S:g} s; log {self.log_path}:\n"
                           f"{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text()[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self._log.close()

