"""``model``: which policy to load and how."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from mmrlhf.config.base import Section


class LoraConfig(Section):
    """LoRA (peft) adapters on the policy (its language model; the vision side with ``vision``); ``rank: 0`` trains
    the full model."""

    rank: int = Field(default=0, ge=0)
    """Adapter rank r; 0 disables LoRA (full fine-tuning)."""
    alpha: float = Field(default=16.0, gt=0)
    """Scaling numerator: the adapter's update is multiplied by ``alpha / rank``."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input (training forwards only)."""
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Linear layers of the LANGUAGE model (by module name suffix) that get adapters (the vision side: ``vision``)."""
    vision: Literal["none", "tower", "merger", "both"] = "none"
    """Adapters on the vision side too: ``tower`` on every Linear layer of the vision blocks (attention and MLP;
    the patch embedding is a convolution and keeps its weights), ``merger`` on every Linear layer of the merger(s)
    that map vision features into the language model (Qwen3-VL's deepstack mergers included), ``both``; ``none``:
    the vision side keeps its weights. With LoRA only the adapters train: every base weight stays frozen whatever
    ``trainer.freeze_vision_tower`` / ``trainer.freeze_merger`` say (``trainer.freeze_vision_tower=false`` is
    refused: adapt the tower with this key instead). The engine gets them like the language adapters
    (``sync``: merged weights, or vLLM's own LoRA with its tower / connector support switched on)."""
    sync: Literal["merged", "vllm_lora"] = "merged"
    """How the engine generates with the current adapter: ``merged`` pushes W + (alpha/r) B A of the adapted layers
    into the engine (plain weights, works with every engine); ``vllm_lora`` loads the adapter into vLLM's own LoRA
    support (only the A/B matrices travel)."""
    adapter: str = ""
    """A saved peft adapter folder to start from (empty: fresh adapters, B = 0, so the first policy is the base)."""
    base_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """What the frozen Linear weights of a LoRA policy are stored in (the adapted layers' bases, the lm_head, the
    vision blocks): they never step, so they need no float32 master. ``bfloat16`` halves them (a 7B base: 28 ->
    14 GiB) and its forwards are autocast's exactly (autocast computed them from the same bf16 values); the
    embeddings and norms stay float32 (they feed the float32 residual stream), the adapters are float32 masters.
    ``auto``: ``model.dtype`` when the trainer runs on an accelerator, float32 on the CPU (bf16 storage is slow to
    compute with on CPUs without bf16 instructions)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "include_vision" in data:
            raise ValueError("model.lora.include_vision was replaced by model.lora.vision (none | tower | merger | "
                             "both): tower adapts every Linear layer of the vision blocks")
        return data


class ModelConfig(Section):
    """Read by the model builders (actor, reference) and the rollout engine."""

    pretrain: str = ""
    """Local path (or hub id, if the user's machine reaches a hub) of the policy model; empty until set."""
    family: Literal["auto", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"] = "auto"
    """Model-family adapter to use; ``auto`` reads ``model_type`` from the model's config."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """COMPUTE dtype of the policy, reference and critic forwards and backwards. Below float32, the trained models
    (actor, critic) keep float32 master weights, gradients and AdamW state (an lr ~1e-6 update is below half a bf16
    ulp of a typical weight and would round away in bf16 parameters): one process and the Ray trainer autocast their
    forwards to this dtype, torchrun's FSDP2 casts the float32 shards to it (``MixedPrecisionPolicy``). The
    reference, which never trains, is stored in this dtype. Checkpoints hold the float32 master weights.
    ``float16`` is refused (it would need a gradient scaler): use ``bfloat16``."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel for transformers forwards (``flash_attention_2`` needs a GPU and the flash-attn package)."""
    masked_attention: Literal["auto", "dense", "flex"] = "auto"
    """How the packed rows (``trainer.packing_samples``) and the shared-prompt rows (``trainer.shared_prompt``)
    attend, where several sequences share a row and a mask keeps them apart. ``flex``: PyTorch's FlexAttention with a
    block mask (tiles the mask hides are skipped, tiles it shows run unmasked), beside the kernel
    ``attn_implementation`` names for everything else (``sdpa`` or ``flash_attention_2``); it also lets the
    shared-prompt layout run with ``flash_attention_2``; and the vision tower (frozen or training) runs all its
    images, frames and windows in one call per block instead of one SDPA call per segment. ``dense``: the mask as a
    dense tensor (``sdpa`` / ``eager`` read it; transformers builds the packed one), the vision tower's loop.
    ``auto``: ``flex`` on CUDA, except the shared-prompt rows where ``attn_implementation`` reads a mask (SDPA's
    masked kernel measured as fast there); ``dense`` elsewhere (FlexAttention has no CPU backward in torch 2.14),
    with the vision tower's segments in one batched SDPA call per segment length instead of the loop.
    All compute the same values (tested per family and prompt kind; docs/training.md)."""
    linear_attention_kernel: str = "auto"
    """How the Gated DeltaNet (linear-attention) layers of the hybrid families (``qwen3_5``, ``qwen3_5_moe``) run a
    batch of several sequences (packed rows, padded batches, shared-prompt rows). ``torch``: each sequence gathered
    into a right-padded batch and run through the layer's own functions (transformers' torch fallbacks on the CPU);
    the reference, exact in every layout. ``fla``: flash-linear-attention's variable-length chunked kernel, the
    sequences' tokens in one row with their boundaries and initial states (CUDA; no padding rows; bf16 compute:
    fla has no float32 kernel, so a float32 forward takes the torch path).
    ``auto``: ``fla`` on CUDA where the package is installed and ``mmrlhf doctor --gpu`` compared it with the torch
    rule on this machine and it passed (its proof record, keyed by the GPU and the torch / fla / triton versions),
    else ``torch``; the choice and why are logged once. ``fla`` runs it unchecked. ``mmrlhf doctor`` reports the path
    a run takes (docs/models.md)."""
    trust_remote_code: bool = False
    """Allow model repositories to run their own Python code (off: only transformers' built-in families)."""
    reference: str = ""
    """Path of the reference (initial) policy; empty means the same weights as ``pretrain``."""
    teacher: str = ""
    """Path of the on-policy distillation teacher (read only when ``algorithm.distill_coef`` or
    ``algorithm.distill_loss_coef`` is > 0): a model of the
    same family and tokenizer (in real recipes a larger size), loaded and run as the reference is (stored in
    ``dtype``, one full copy per scoring process, never trained), scoring the student's sampled responses with their
    images in the same forwards phase."""
    critic: str = ""
    """Path of the model whose decoder initialises the PPO critic (a zero-initialised value head is added); empty
    means ``pretrain``. Only read when the advantage estimator needs values (``gae``)."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters instead of full fine-tuning (``lora.rank > 0``)."""

    @model_validator(mode="after")
    def _check_dtype(self) -> "ModelConfig":
        if self.dtype == "float16":
            raise ValueError("model.dtype=float16: float16 training needs a gradient scaler (small gradients underflow "
                             "to zero), which the trainer does not have; use model.dtype=bfloat16 (same memory and "
                             "speed on GPUs that have it, float32's exponent range) or float32")
        return self
