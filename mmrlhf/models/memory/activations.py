"""Activation memory of one training micro-batch: what autograd keeps between the forward and the backward.

Every term below is a tensor the backward needs, as transformers 5.x's Qwen2-style decoder layer and
:class:`~mmrlhf.models.actor.ActorVL` save it; ``tests/models/test_memory_activations.py`` counts the bytes autograd
really saves (``torch.autograd.graph.saved_tensors_hooks``) on small random models and holds this formula to them.
Per decoder layer and token (h hidden, q = heads x head_dim, kv = kv_heads x head_dim, I intermediate; f = 4 bytes,
r = the residual stream's bytes, c = the compute dtype's):

* each RMSNorm: its input upcast to float32 (f h; the input itself when the stream is float32), ``x * rsqrt`` as
  the weight multiply sees it (r h), the row's rsqrt (f), and its output as the next Linear layers read it: once
  (r h), or under autocast once PER consumer, each casting it on its own (3 c h for q / k / v, 2 c h for gate / up);
* attention (SDPA's flash / memory-efficient kernels, and flash-attention 2: outputs and log-sum-exp, no
  probabilities): q, k, v, output (c each; the output is also ``o_proj``'s input) and f x heads of log-sum-exp.
  With an attention mask (padding, packing, shared prompts under ``sdpa``) transformers repeats k and v to every
  query head before the kernel (``repeat_kv``), so k and v cost c q instead of c kv; ``eager`` attention also keeps
  the [heads, S, S] probabilities (f + c each);
* Qwen3's per-head q / k RMSNorms: f + c per element of q and k;
* the SwiGLU MLP: gate output, its activation, up output and their product (4 c I); a routed-experts MLP (MoE)
  the same per token and chosen expert at the expert's size, plus the gathered inputs, the outputs and the
  router's softmax (:func:`moe_mlp_bytes`); under autocast every expert's weights are cast at each forward (a
  training micro-batch reaches them all) and the copies kept, with or without the compute copy.

With a mask, each layer also keeps its own [rows, 1, S, S] copy of it in c (SDPA converts a boolean mask at every
call): quadratic in a packed row's length. Per forward: the token ids, the rotary cos / sin, the final norm, and the
chunked log-prob head's input (the N response rows, c h each). Under autocast (one process: float32 parameters,
``model.dtype`` compute) every Linear weight on the backward's path is cast to c once and the cast copy is saved:
a c-byte copy of the decoder's Linear weights and of the lm_head (FSDP2's mixed precision gathers c-byte parameters
instead, and frees them after each layer). Activation checkpointing (every decoder layer and vision block,
``mmrlhf.models.sharding.checkpoint_blocks``) keeps only each layer's input (r h) and recomputes one layer at a time
in the backward.

Not saved, but alive at the peak: the log-prob head's chunk ([chunk, V] logits in c and float32, and the float32
gradient of the logits) plus, when the lm_head trains, its float32 gradient accumulator and a c copy ([V, h] each,
``mmrlhf.models.logprobs``), and the backward's working set, taken as one layer's saved tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmrlhf.models.memory.counts import ModelFacts

F32 = 4
INT64 = 8


@dataclass(frozen=True)
class Numerics:
    """How a training forward stores its tensors (bytes per element)."""

    residual: int  # the residual stream: float32 under autocast (the token embedding is not autocast)
    compute: int  # matmul inputs and outputs (``model.dtype``)
    autocast: bool  # float32 parameters under torch.autocast: per-consumer casts and saved weight copies


def numerics(compute_bytes: int, master_bytes: int, *, sharded: bool) -> Numerics:
    """The storage rule of :mod:`mmrlhf.models.precision` for one launch: ``sharded`` (FSDP2's mixed precision
    casts the parameters themselves, so the stream is in the compute dtype) or not (autocast over float32
    parameters when the compute dtype is narrower than the master)."""
    if sharded or compute_bytes == master_bytes:
        return Numerics(residual=compute_bytes, compute=compute_bytes, autocast=False)
    return Numerics(residual=master_bytes, compute=compute_bytes, autocast=True)


@dataclass(frozen=True)
class MicroBatch:
    """The largest training micro-batch, as the forward sees it."""

    rows: int  # sequences of the layout (padded: samples; packed: 1; shared prompt: grouped rows)
    row_tokens: int  # S: the attention span of a row
    response_tokens: int  # N: rows the log-prob head scores
    vision_patches: int  # patches the vision tower sees (0: text only)
    mask: bool  # an attention mask is materialised (sdpa / eager with padding, packing or shared prompts)
    eager: bool = False  # eager attention: probabilities are kept
    real_tokens: int | None = None  # tokens when rows are not all full (shared-prompt rows); None: rows x S

    @property
    def tokens(self) -> int:
        return self.rows * self.row_tokens if self.real_tokens is None else self.real_tokens


def decoder_layer_bytes(facts: ModelFacts, n: Numerics, mb: MicroBatch) -> dict[str, int]:
    """Bytes one decoder layer saves for micro-batch ``mb``, by part (the module docstring's list)."""
    d, c, r = facts.decoder, n.compute, n.residual
    tokens, mask = mb.tokens, mb.mask
    h = d.hidden

    def norm(consumers: int) -> int:
        out = consumers * c * h if n.autocast else r * h
        return F32 * h + r * h + F32 + out

    kv = d.q_dim if mask else d.kv_dim
    attention = c * (2 * d.q_dim + 2 * kv) + F32 * d.heads
    if d.attn_output_gate:  # Qwen3.5: q_proj also yields a gate; sigmoid(gate) and the gated output are kept
        attention += 2 * c * d.q_dim
    qk_norm = (F32 + c) * (d.q_dim + d.kv_dim) + F32 * (d.heads + d.kv_heads) if d.qk_norm else 0
    # torch's SDPA turns a boolean mask into an additive one in the query's dtype at every call, and the kernel
    # saves it: one [rows, 1, S, S] copy per layer (measured on the CPU; the CUDA kernels convert the same way)
    mask_bytes = mb.rows * mb.row_tokens**2 * c if mask else 0
    return {"norms": tokens * (norm(3) + norm(2)), "attention": tokens * (attention + qk_norm) + mask_bytes,
            "mlp": tokens * 4 * c * d.intermediate}


def moe_mlp_bytes(facts: ModelFacts, n: Numerics, tokens: int) -> int:
    """A routed-experts MLP's saved tensors for ``tokens`` tokens (transformers' experts, as measured on the CPU):
    per token and chosen expert (k of them) the gathered input and the down projection's output (c h each), the
    gate / up output, the activation and the product (4 c I), its routing weight and three int64 indices; per
    token the router's float32 softmax over the E experts and its top-k values. A shared expert (Qwen3.5-MoE) is a
    dense SwiGLU of its own size plus its gate."""
    d, c = facts.decoder, n.compute
    routed = d.top_k * (c * (2 * d.hidden + 4 * d.moe_intermediate) + c + 3 * INT64) + F32 * (d.experts + d.top_k + 1)
    shared = 4 * c * d.shared_intermediate + 2 * c if d.shared_intermediate else 0
    return tokens * (routed + shared)


KERNEL_CHUNK = 64  # the chunked delta rule's chunk length (fla's chunk_gated_delta_rule)


def linear_attention_bytes(facts: ModelFacts, n: Numerics, tokens: int) -> int:
    """A Gated DeltaNet (linear-attention) token mixer's saved tensors for ``tokens`` tokens, as fla's chunked
    kernel and causal-conv1d keep them on a GPU (K = key heads x key size, V = value heads x value size, H value
    heads): the fused q / k / v projection (the convolution's input) and the convolution's output (c (2K + V)
    each), q and k repeated to the value heads when there are more of those, the output gate z (c V), beta (c H),
    the decay's float32 input and value (2 f H), the kernel's q / k normalisation statistics (2 f H) and its chunk
    matrix (c H x 64), the kernel's output (c V), and the gated RMSNorm's float32 input and gate, statistics and
    output (out_proj's input). An ESTIMATE from those kernels' saved inputs: the CPU's torch fallback keeps its
    loop's intermediates instead (about twice as much), so it cannot be measured here. The recurrent state itself
    is recomputed per chunk in the backward (transient)."""
    d, c = facts.decoder, n.compute
    k, v, h = d.linear_k_heads * d.linear_k_dim, d.linear_v_heads * d.linear_v_dim, d.linear_v_heads
    repeat = 2 * h * d.linear_k_dim if d.linear_v_heads > d.linear_k_heads else 0
    per_token = (2 * c * (2 * k + v) + c * repeat + c * v + c * h + 2 * F32 * h + 2 * F32 * h
                 + c * h * KERNEL_CHUNK + c * v + 2 * F32 * v + F32 * h + c * v)
    return tokens * per_token


def layer_bytes(facts: ModelFacts, n: Numerics, mb: MicroBatch) -> list[tuple[int, int]]:
    """(layers, bytes one of them saves) per kind of decoder layer: attention or linear-attention token mixer
    (:func:`linear_attention_bytes`, whose input norm feeds four projections), dense or routed-expert MLP
    (:func:`moe_mlp_bytes`; where only some layers route, assumed spread evenly over both mixers)."""
    d, c = facts.decoder, n.compute
    parts = decoder_layer_bytes(facts, n, mb)
    attention = sum(parts.values()) - parts["mlp"] + eager_probabilities_bytes(facts, mb, n)
    mixers = [(d.attention_layers, attention)]
    if d.linear_layers:
        # the input norm's output read by four projections (qkv, z, b, a) instead of attention's three
        extra_consumer = mb.tokens * c * d.hidden if n.autocast else 0
        norms = parts["norms"] + extra_consumer
        mixers.append((d.linear_layers, norms + linear_attention_bytes(facts, n, mb.tokens)))
    moe_share = d.moe_layers / max(d.layers, 1)
    kinds = []
    for count, mixer in mixers:
        routed = round(count * moe_share)
        kinds.append((count - routed, mixer + parts["mlp"]))
        kinds.append((routed, mixer + moe_mlp_bytes(facts, n, mb.tokens)))
    return [(count, b) for count, b in kinds if count]


def eager_probabilities_bytes(facts: ModelFacts, mb: MicroBatch, n: Numerics) -> int:
    """``eager`` attention keeps each layer's [rows, heads, S, S] probabilities (float32 softmax and its cast)."""
    if not mb.eager:
        return 0
    return mb.rows * facts.decoder.heads * mb.row_tokens**2 * (F32 + n.compute)


def per_forward_bytes(facts: ModelFacts, n: Numerics, mb: MicroBatch) -> int:
    """Saved once per forward: ids, rotary cos / sin, final norm, the head's input rows."""
    d, c, r = facts.decoder, n.compute, n.residual
    t = mb.tokens
    head_rows = mb.response_tokens * (c * d.hidden + 3 * INT64 + 2 * F32)  # input rows, indices, log-probs, lse
    return t * (INT64 + 2 * d.head_dim * r + F32 * d.hidden + r * d.hidden + F32) + head_rows


def vision_bytes(facts: ModelFacts, n: Numerics, mb: MicroBatch, *, checkpointing: bool) -> int:
    """Saved by the vision side when the backward runs through it: each tower block's Linear inputs and outputs
    plus its norms per patch (checkpointed: the block input only), the mergers' per merged token, and the mask
    that scatters the vision features into the token embeddings (1 byte per token and hidden unit)."""
    c, v = facts.counts, facts.vision
    if not c.merger_on_grad_path or not mb.vision_patches:
        return 0
    p = mb.vision_patches
    merged = p // max(v.merge, 1)
    total = merged * n.compute * v.merger_linear_features + p * (F32 + n.residual) * v.width
    total += mb.tokens * facts.decoder.hidden
    if c.tower_on_grad_path:
        # a block's Linear inputs and outputs, its rotary q / k and attention output (new tensors beside the
        # fused qkv output), and two norms' float32 statistics per patch; checkpointed: its input only
        linear = n.compute * (v.block_linear_features + 3 * v.width) + 2 * F32 * v.width
        block = n.residual * v.width if checkpointing else linear
        total += v.depth * p * block
    return total


def weight_copy_bytes(facts: ModelFacts, n: Numerics, *, checkpointing: bool, compute_copy: bool = False) -> int:
    """Autocast's c-byte copies of the Linear weights on the backward's path, kept until the backward: every
    decoder layer's (one at a time when checkpointed: the recomputed layer's, counted there), the lm_head's (the
    chunked head saves its cast weight) and the vision side's the backward runs through; 0 without autocast.
    ``compute_copy`` (``trainer.compute_copy``, :mod:`mmrlhf.models.compute_copy`): instead, a c-byte copy of
    EVERY Linear weight (the frozen tower's too) held through the update, checkpointed or not."""
    if not n.autocast:
        return 0
    d, c = facts.decoder, facts.counts
    # the routed experts: cast at every forward (checkpointed: in the recomputation, one layer at a time)
    experts = 0 if checkpointing else c.expert_weights
    if compute_copy:
        return n.compute * (c.linear_weights + d.vocab * d.hidden + c.merger_linear_weights + c.tower_linear_weights
                            + experts)
    layers = 0 if checkpointing else c.linear_weights + experts
    vision = c.merger_linear_weights if c.merger_on_grad_path else 0
    vision += c.tower_linear_weights if c.tower_on_grad_path else 0
    return n.compute * (layers + d.vocab * d.hidden + vision)


def head_working_bytes(facts: ModelFacts, n: Numerics, rows: int, chunk: int, *, train: bool) -> int:
    """The chunked log-prob head's live buffers at its peak (``mmrlhf.models.logprobs``): a chunk of logits in c
    and float32 and, in the backward, their float32 gradient; when the lm_head trains, the backward's float32
    accumulator of its gradient and the cast back to the weight's dtype ([V, h] each)."""
    d, c = facts.decoder, n.compute
    logits = min(chunk, max(rows, 1)) * d.vocab * (c + 2 * F32)
    if not train:
        return logits
    accumulator = d.vocab * d.hidden * (F32 + c) if facts.counts.lm_head_trains else 0
    return logits + accumulator


@dataclass(frozen=True)
class ActivationPlan:
    """Bytes of one training micro-batch beyond the model's states, by part."""

    layers: int  # the decoder layers' saved tensors (checkpointed: their inputs)
    per_forward: int
    vision: int
    weight_copies: int  # autocast's saved weight copies, or the compute copy (trainer.compute_copy)
    recompute: int  # checkpointing: one layer's saved tensors (and weight copies) during its recomputation
    head: int  # the log-prob head's chunk buffers and gradient accumulator (transient)
    backward: int  # the backward's working set: one layer's worth of gradients (transient)

    @property
    def saved(self) -> int:
        """What autograd keeps after the forward (what ``saved_tensors_hooks`` sees)."""
        return self.layers + self.per_forward + self.vision + self.weight_copies

    @property
    def total(self) -> int:
        return self.saved + self.recompute + self.head + self.backward


def activation_plan(facts: ModelFacts, n: Numerics, mb: MicroBatch, *, checkpointing: bool,
                    chunk: int, compute_copy: bool = False) -> ActivationPlan:
    """Activations of one training forward + backward of ``mb`` (the module docstring's formula); with
    ``compute_copy`` the weight copies are the step's (:func:`weight_copy_bytes`), and a recomputed layer casts
    none of its own."""
    d, c = facts.decoder, facts.counts
    kinds = layer_bytes(facts, n, mb)
    one = max(b for _, b in kinds)
    if checkpointing:
        layers = d.layers * mb.tokens * n.residual * d.hidden
        linear = 0 if compute_copy else c.linear_weights // max(d.layers, 1)
        experts = c.expert_weights // max(d.moe_layers, 1)  # never in the compute copy
        recompute = one + (n.compute * (linear + experts) if n.autocast else 0)
    else:
        layers, recompute = sum(count * b for count, b in kinds), 0
    return ActivationPlan(
        layers=layers, per_forward=per_forward_bytes(facts, n, mb),
        vision=vision_bytes(facts, n, mb, checkpointing=checkpointing),
        weight_copies=weight_copy_bytes(facts, n, checkpointing=checkpointing, compute_copy=compute_copy),
        recompute=recompute,
        head=head_working_bytes(facts, n, mb.response_tokens, chunk, train=True), backward=one)


def scoring_bytes(facts: ModelFacts, n: Numerics, tokens: int, response_tokens: int, chunk: int) -> int:
    """Peak working memory of a no-grad forward (experience making: old / reference log-probs, values): one
    layer's intermediates at a time, the hidden states, and the head's chunk."""
    one = max(b for _, b in layer_bytes(facts, n, MicroBatch(1, tokens, response_tokens, 0, mask=False)))
    return one + tokens * n.residual * facts.decoder.hidden + head_working_bytes(facts, n, response_tokens, chunk,
                                                                                  train=False)
