"""``ActorVL``: log-probs (and entropy) of the response tokens of a Qwen-VL policy, padded or packed layout.

The forward runs the base model (vision tower + decoder, no lm_head) once for the whole micro-batch, picks the
hidden states that predict response tokens, and hands only those rows to :func:`chunked_log_probs`. Prompt
positions never reach the lm_head, and no [B, S, V] logits tensor exists at any point.

Packed layout: one [1, T] sequence with explicit positions ([4, 1, T]: per-sample text positions first, then
M-RoPE) and no 2-D attention mask. transformers (5.19, ``masking_utils.find_packed_sequence_indices``) reads the
text row, sees positions restart, and builds a block-diagonal causal mask, so each sample attends only to itself;
this is the library's own packing path (sdpa and eager verified by the tests on CPU; flash-attention takes the
same row to derive varlen boundaries, not verified here). Vision tensors of all samples go in concatenated: the
vision tower treats each grid independently.

Grouped layout (``GroupedSamples``, built by :mod:`mmrlhf.experience.grouped`): one row per shared prompt followed
by its responses, a [G, 1, L, L] mask (:mod:`mmrlhf.models.shared_prompt`) and per-response positions; the prompt
and its images go through the model once per row instead of once per sample.

Recurrent decoder layers (Gated DeltaNet, ``adapter.recurrent_layers``) read no mask: the actor hands them where each
sample lies, and they run every sample from its own first token (:mod:`mmrlhf.models.linear_attention`); in the
grouped layout they run the prompt once and continue every response from its state.

All layouts return [B, A] tensors (A = longest response) in sample order plus the action mask, so callers are
layout-agnostic.

Sharding (FSDP2, ``torch.distributed.fsdp.fully_shard``): the forward calls ``model.base_model`` and reads
``lm_head.weight`` for the chunked head itself, never through the HF model's or the lm_head's own forward, so their
parameters must be gathered by the ACTOR's forward. Shard it with :func:`mmrlhf.models.sharding.shard_for_training`:
``fully_shard`` on every transformer block (the model's ``_no_split_modules``: decoder layers and vision blocks),
then ``fully_shard(actor)`` as the root, which owns the embeddings, final norm, lm_head and vision merger. Never
``fully_shard`` the HF model, its lm_head or its embeddings on their own (refused with an error). The same holds for
:class:`~mmrlhf.models.critic.CriticVL` (root = the critic). ``hidden_states`` of a sharded actor is registered as
a forward method, so a direct call gathers too.

Precision (:mod:`mmrlhf.models.precision`): ``compute_dtype`` set (float32 master parameters, bf16 compute) runs
:meth:`ActorVL.forward` and :meth:`ActorVL.hidden_states` under ``torch.autocast`` to that dtype, and the chunked
lm_head in it; None computes in the parameters' own dtype (float32 runs, a model stored in bf16, or FSDP2's
mixed precision, which casts the parameters itself).

Routed experts (:mod:`mmrlhf.models.routing`): with ``routing_replay="replay"``, a batch of any layout that
carries the engine's expert choice (``routed_experts``, laid out like its ``sequences``) is scored with the routers
held to it, in every forward (scoring and update); ``return_routing`` hands back what the routers did (the
load-balancing loss and the routing metrics read it).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch
from torch import nn

from mmrlhf.models import linear_attention
from mmrlhf.models.adapters import FamilyAdapter, get_adapter
from mmrlhf.models.attention import (base_implementation, block_mask, install, install_vision,
                                     resolve_masked_attention, row_segments, rows_kernel)
from mmrlhf.models.batch import GroupedSamples, SamplesVL, pad_positions, split_vision_inputs
from mmrlhf.models.delta_kernels import check_setting, resolve_delta_kernel, varlen_rule
from mmrlhf.models.fsdp_layout import check_wrapper_layout
from mmrlhf.models.logprobs import chunked_sampled_log_probs
from mmrlhf.models.placement import module_device, to_device
from mmrlhf.models.precision import autocast
from mmrlhf.models.routing import ROUTING_MODES, RoutingTrace, routing
from mmrlhf.models.positions import grouped_position_ids, packed_position_ids, padded_position_ids
from mmrlhf.models.shared_prompt import grouped_attention_mask
from mmrlhf.models.truncation import Truncation


class ActionLogProbs(NamedTuple):
    log_probs: torch.Tensor  # [B, A] float32 log-prob of each response token; 0 where action_mask is False
    entropy: torch.Tensor | None  # [B, A] float32 next-token entropy at each response position (0 off-mask)
    action_mask: torch.Tensor  # [B, A] bool
    # [B, A] bool: scored under a truncation, the token lay outside its kept set and was scored untruncated
    # (mmrlhf.models.logprobs); None when no truncation was asked for
    outside: torch.Tensor | None = None
    # return_routing: what the routers of a mixture-of-experts decoder did in this forward (indices and logits per
    # routed layer over the batch's flattened tokens, and which of those tokens are real); None otherwise
    routing: RoutingTrace | None = None
    # topk > 0: this model's k largest log-probs at each response position and their ids, [B, A, k] float32 / long
    # (0 off the mask): what a distillation teacher records (mmrlhf.algorithms.distill_topk); None otherwise
    topk_log_probs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    # gather_ids given: this model's log-probs at those ids, [B, A, k] float32, differentiable (0 off the mask)
    gathered_log_probs: torch.Tensor | None = None


def response_index(samples: SamplesVL) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the scored response tokens are, for any layout: every response token, or, where the samples carry a
    policy mask (multi-turn trajectories: ``action_mask`` in every layout), the policy's tokens only; observation
    tokens are attended to but never scored.

    Returns (flat positions of the tokens that PREDICT each response token [N] (into sequences.flatten()),
    flat positions of the response tokens themselves [N], action mask [B, A] bool). N = total response tokens,
    ordered sample by sample, matching ``action_mask.nonzero()`` order.
    """
    device = samples.sequences.device
    if isinstance(samples, GroupedSamples):
        return _grouped_response_index(samples)
    if samples.packed:
        lens = samples.packed_seq_lens.to(device)  # [B]
        acts = torch.as_tensor(samples.num_actions, device=device).long()  # [B]
        a_max = int(acts.max()) if acts.numel() else 0
        action_mask = torch.arange(a_max, device=device)[None] < acts[:, None]  # [B, A]
        if samples.action_mask is not None:  # multi-turn: the policy tokens of each response only
            action_mask = action_mask & samples.action_mask.to(device).bool()[:, :a_max]
        ends = lens.cumsum(0)  # [B] exclusive end of each sample
        first = (ends - acts)[:, None] + torch.arange(a_max, device=device)[None]  # [B, A] response token index
        targets = first[action_mask]  # [N]
    else:
        action_mask = samples.action_mask.to(device).bool()  # [B, A]
        b, s = samples.sequences.shape
        a = action_mask.shape[1]
        cols = torch.arange(s - a, s, device=device)[None] + torch.arange(b, device=device)[:, None] * s  # [B, A]
        targets = cols[action_mask]  # [N]
    return targets - 1, targets, action_mask


def _grouped_response_index(samples: GroupedSamples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``response_index`` of the grouped layout: a response's first token is predicted by the LAST PROMPT token of
    its row (shared by the row's responses), every later one by the token before it in the same response."""
    device = samples.sequences.device
    width = samples.sequences.shape[1]
    acts = samples.response_length.to(device)  # [B]
    a_max = int(acts.max()) if acts.numel() else 0
    steps = torch.arange(a_max, device=device)[None]  # [1, A]
    action_mask = steps < acts[:, None]  # [B, A]
    if samples.action_mask is not None:  # multi-turn: the policy tokens of each response only
        action_mask = action_mask & samples.action_mask.to(device).bool()[:, :a_max]
    row_base = samples.sample_row.to(device)[:, None] * width  # [B, 1] flat offset of each sample's row
    tgt = row_base + samples.sample_start.to(device)[:, None] + steps  # [B, A] flat response-token positions
    last_prompt = row_base + samples.prompt_lengths.to(device)[samples.sample_row.to(device)][:, None] - 1  # [B, 1]
    src = torch.where(steps == 0, last_prompt, tgt - 1)  # [B, A]
    return src[action_mask], tgt[action_mask], action_mask


class ActorVL(nn.Module):
    """A Qwen-VL ``...ForConditionalGeneration`` model scored on response tokens only.

    ``micro_batch_size`` in :meth:`forward` runs samples in groups (each group re-laid-out in the same layout) and
    concatenates the [b, A] results; None runs the whole batch at once. That bounds memory for scoring under
    ``torch.no_grad()`` (experience making). For training, the graphs of all groups would stay alive until the
    backward: the trainer should call ``forward`` per micro-batch and backward each (gradient accumulation).
    """

    def __init__(self, model: Any, adapter: FamilyAdapter | None = None, *, chunk_size: int = 1024,
                 excluded_token_ids: Sequence[int] | None = None, compute_dtype: torch.dtype | None = None,
                 masked_attention: str = "auto", routing_replay: str = "none", linear_attention_kernel: str = "auto"):
        super().__init__()
        self.model = model
        self.adapter = adapter if adapter is not None else get_adapter(model.config)
        self.chunk_size = chunk_size
        self.excluded_token_ids = excluded_token_ids
        self.compute_dtype = compute_dtype  # autocast dtype of the forwards; None: the parameters' own dtype
        resolve_masked_attention(masked_attention, "cpu", base_implementation(model))  # refuse a bad setting now
        self.masked_attention = masked_attention  # model.masked_attention: kernel of packed / grouped rows
        # Recurrent (linear-attention) layers restart at packed boundaries (mmrlhf.models.linear_attention)
        if self.adapter.recurrent_layers and not linear_attention.install(model) \
                and linear_attention.declares_recurrent(model):
            raise ValueError(f"{self.adapter.family} has recurrent decoder layers but none was found in "
                             f"{type(model).__name__} (in_proj_qkv, conv1d, A_log, dt_bias): packed rows would leak")
        check_setting(linear_attention_kernel)  # refuse an unknown name now (the device: at each forward)
        self.linear_attention_kernel = linear_attention_kernel  # model.linear_attention_kernel (recurrent layers)
        if routing_replay not in ROUTING_MODES:
            raise ValueError(f"routing_replay must be one of {ROUTING_MODES}, got {routing_replay!r}")
        self.routing_replay = routing_replay  # rollout.routing_replay: "replay" holds the routers to the engine's

    def masked_kernel(self) -> str:
        """``flex`` or ``dense``: how this actor's packed and grouped rows attend, on the device it computes on now
        (:func:`mmrlhf.models.attention.resolve_masked_attention`); ``flex`` installs the block-sparse function in
        the decoder the first time (it stays: a model keeps one attention function, see that module), and ``auto``
        the varlen vision function wherever the decoder stays dense (the tower's segments batched)."""
        kernel = resolve_masked_attention(self.masked_attention, self.device, base_implementation(self.model))
        if kernel == "flex":
            install(self.model)
        elif self.masked_attention == "auto":  # the decoder dense here; the vision tower's segments batched
            install_vision(self.model)
        return kernel

    def _autocast(self) -> Any:
        """The forward's precision context (see the module docstring, "Precision")."""
        return autocast(self.model.get_input_embeddings().weight.device, self.compute_dtype)

    @property
    def excluded_token_ids(self) -> tuple[int, ...]:
        """Tokens removed from the scored distribution: the ones the rollout engines never sample (default: the
        family's vision special tokens; the experience builder adds the configured forbidden ids). Scoring the
        same restricted distribution the engine sampled from keeps the engine/trainer comparison and the
        importance ratios exact (on a tiny random model those tokens hold ~1% of the probability mass)."""
        return self._excluded

    @excluded_token_ids.setter
    def excluded_token_ids(self, ids: Sequence[int] | None) -> None:
        ids = self.adapter.vision_special_token_ids() if ids is None else ids
        self._excluded = tuple(sorted({int(i) for i in ids}))
        self._excluded_tensor = torch.tensor(self._excluded, dtype=torch.long) if self._excluded else None

    @classmethod
    def from_pretrained(cls, path: str, *, chunk_size: int = 1024, adapter: FamilyAdapter | None = None,
                        excluded_token_ids: Sequence[int] | None = None, compute_dtype: torch.dtype | None = None,
                        masked_attention: str = "auto", routing_replay: str = "none",
                        linear_attention_kernel: str = "auto", **model_kwargs: Any) -> "ActorVL":
        """Load ``path``; ``adapter`` (e.g. an explicitly configured family) defaults to the config's own.
        ``model_kwargs`` go to transformers (``dtype`` there is the STORAGE dtype; ``compute_dtype`` the autocast
        one)."""
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(path, **model_kwargs)
        return cls(model, adapter if adapter is not None else get_adapter(model.config), chunk_size=chunk_size,
                   excluded_token_ids=excluded_token_ids, compute_dtype=compute_dtype,
                   masked_attention=masked_attention, routing_replay=routing_replay,
                   linear_attention_kernel=linear_attention_kernel)

    # ---- one micro-batch ----------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Where this actor computes: its parameters' device (the rank's device under FSDP2)."""
        return module_device(self)

    def hidden_states(self, samples: SamplesVL | GroupedSamples,
                      vision_extra: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Final (normed) decoder hidden states [B, S, H] (padded), [1, T, H] (packed) or [G, L, H] (grouped), on
        this actor's device (the inputs are moved there)."""
        check_wrapper_layout(self.model)
        position_ids, mixer = self.position_ids(samples, vision_extra), self._mixer_kwargs(samples)
        samples, vision_extra, position_ids, mixer = to_device((samples, vision_extra, position_ids, mixer),
                                                               self.device)
        with self._autocast():
            return self._hidden_states(samples, vision_extra, position_ids, mixer)

    def position_ids(self, samples: SamplesVL | GroupedSamples,
                     vision_extra: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """M-RoPE positions of any layout, computed where ``samples`` are (the host, where batches are built):
        the rule runs one small call per sample or row, which on an accelerator would be dozens of tiny kernels
        and host syncs per forward (measured: a packed micro-batch at 7B shape left the GPU idle ~25% of its
        step); on the host it is integer arithmetic, moved once. [3, B, S] padded, [4, 1, T] packed (row 0: per-
        sample text positions), [3, G, L] grouped."""
        if isinstance(samples, GroupedSamples):
            return grouped_position_ids(self.adapter, samples, vision_extra)
        if samples.packed:
            return packed_position_ids(self.adapter, samples, vision_extra)
        return padded_position_ids(self.adapter, samples, vision_extra)

    def _mixer_kwargs(self, samples: SamplesVL | GroupedSamples) -> dict[str, Any]:
        """Extra keywords of the decoder's token mixers, built on the host: where each sample lies (packed row or
        padded batch; a grouped row's prompt and responses), for recurrent layers (:mod:`mmrlhf.models.
        linear_attention`); none otherwise."""
        if not self.adapter.recurrent_layers:
            return {}
        rule = varlen_rule(self.delta_kernel())
        varlen = {} if rule is None else {linear_attention.VARLEN_KWARG: rule}
        if isinstance(samples, GroupedSamples):
            tree = linear_attention.tree_segments(samples.sequences.shape[1], *(x.cpu() for x in (
                samples.prompt_lengths, samples.sample_row, samples.sample_start, samples.response_length)))
            return {linear_attention.SEGMENTS_KWARG: tree, **varlen}
        seg = (linear_attention.segments(samples.packed_seq_lens.cpu()) if samples.packed else
               linear_attention.padded_segments(samples.attention_mask.cpu()))
        return {} if seg is None else {linear_attention.SEGMENTS_KWARG: seg, **varlen}

    def delta_kernel(self) -> str:
        """How this actor's recurrent layers run a batch of sequences on the device it computes on now: ``torch``
        (gathered) or a variable-length kernel's name (:func:`mmrlhf.models.delta_kernels.resolve_delta_kernel`)."""
        return resolve_delta_kernel(self.linear_attention_kernel, self.device)

    def _hidden_states(self, samples: SamplesVL, vision_extra: dict[str, torch.Tensor] | None,
                       position_ids: torch.Tensor, mixer: dict[str, Any],
                       trace: list[RoutingTrace] | None = None) -> torch.Tensor:
        # Not the public name: a sharded actor registers ``hidden_states`` as an FSDP forward method, and the
        # forward, already inside the root's hooks, must not run them a second time.
        grouped = isinstance(samples, GroupedSamples)
        # Decided (and the block-sparse functions installed) for every layout: the vision tower's varlen path
        # serves padded batches too; a padded decoder gets its 2-D mask and the base kernel.
        layout = "grouped" if grouped else "packed" if samples.packed else "padded"
        flex = rows_kernel(self.masked_attention, self.masked_kernel(), layout,
                           base_implementation(self.model)) == "flex"
        if grouped:
            dtype = self.compute_dtype or self.model.get_input_embeddings().weight.dtype
            # [G, 1, L, L] (a 4-D mask passes through to every layer as it is) or the block mask of the G rows
            attention_mask = (block_mask(row_segments(samples)) if flex else
                              grouped_attention_mask(samples.segment_ids, base_implementation(self.model), dtype))
            # recurrent layers read none (their segments carry the tree): a per-layer-type mapping for hybrids
            attention_mask = linear_attention.layer_masks(self.model, attention_mask)
        elif samples.packed:
            # dense: the block-diagonal causal mask transformers builds from position_ids[0]; flex: its block mask
            # (a per-layer-type mapping where recurrent layers read no block mask: mmrlhf.models.linear_attention)
            attention_mask = (linear_attention.layer_masks(self.model, block_mask(row_segments(samples))) if flex
                              else None)
        else:
            attention_mask = samples.attention_mask  # [B, S] 0/1
        replay = samples.routed_experts if self.routing_replay == "replay" else None  # laid out like sequences
        with routing(self.model, replay=replay, record=trace is not None, keep_logits=trace is not None) as used:
            out = self.model.base_model(
                input_ids=samples.sequences,
                attention_mask=attention_mask,
                position_ids=position_ids,
                pixel_values=samples.pixel_values,
                image_grid_thw=samples.image_grid_thws,
                pixel_values_videos=samples.pixel_values_videos,
                video_grid_thw=samples.video_grid_thws,
                mm_token_type_ids=samples.mm_token_type_ids,
                use_cache=False,
                **mixer,
            )
        if trace is not None:
            real = samples.segment_ids >= 0 if grouped else samples.attention_mask != 0  # padding is not routed
            used.token_mask = real.reshape(-1)  # [N] real tokens of the flattened batch
            trace.append(used)
        return out.last_hidden_state

    def _forward_one(self, samples, vision_extra, return_entropy, chunk_size, temperature,
                     truncation, return_routing=False, topk=0, gather_ids=None) -> ActionLogProbs:
        # Positions and the response index come from the host batch (integer bookkeeping: no device syncs), then
        # everything moves here, per micro-batch, after any selection.
        position_ids, mixer = self.position_ids(samples, vision_extra), self._mixer_kwargs(samples)
        index = response_index(samples)  # [N], [N], [B, A]
        samples, vision_extra, position_ids, mixer, (src, tgt, action_mask), gather_ids = to_device(
            (samples, vision_extra, position_ids, mixer, index, gather_ids), self.device)
        trace: list[RoutingTrace] | None = [] if return_routing else None
        hidden = self._hidden_states(samples, vision_extra, position_ids, mixer, trace)  # [B,S,H] | [1,T,H] | [G,L,H]
        h = hidden.reshape(-1, hidden.shape[-1])[src]  # [N, H] only the rows that predict response tokens
        lm_head = self.model.get_output_embeddings()
        weight, bias = lm_head.weight, lm_head.bias
        if self.compute_dtype is not None:  # a custom autograd function: cast its inputs once, as autocast would
            h, weight = h.to(self.compute_dtype), weight.to(self.compute_dtype)
            bias = None if bias is None else bias.to(self.compute_dtype)
        extra = None
        if gather_ids is not None:
            if gather_ids.ndim != 3 or gather_ids.shape[0] != action_mask.shape[0] \
                    or gather_ids.shape[1] < action_mask.shape[1]:
                raise ValueError(f"gather_ids {tuple(gather_ids.shape)} must be [B, >= A, k] over the batch's "
                                 f"action mask {tuple(action_mask.shape)}")
            extra = gather_ids[:, :action_mask.shape[1]][action_mask]  # [N, k] in response-token order
        scored = chunked_sampled_log_probs(
            h, weight, samples.sequences.reshape(-1)[tgt], bias=bias,
            chunk_size=chunk_size, temperature=temperature, return_entropy=return_entropy,
            excluded=self._excluded_tensor, truncation=truncation, extra_targets=extra, topk=topk,
        )  # [N], [N] | None, [N]; [N, k] | None each
        logp, ent, out = scored.log_probs, scored.entropy, scored.outside
        log_probs = logp.new_zeros(action_mask.shape).masked_scatter(action_mask, logp)  # [B, A]
        entropy = None if ent is None else ent.new_zeros(action_mask.shape).masked_scatter(action_mask, ent)
        outside = None
        if truncation is not None and truncation.active:
            outside = torch.zeros_like(action_mask).masked_scatter(action_mask, out)  # [B, A]
        return ActionLogProbs(log_probs, entropy, action_mask, outside, trace[0] if trace else None,
                              _per_position(scored.top_log_probs, action_mask),
                              _per_position(scored.top_ids, action_mask),
                              _per_position(scored.extra_log_probs, action_mask))

    def forward(
        self,
        samples: SamplesVL,
        *,
        vision_extra: dict[str, torch.Tensor] | None = None,
        return_entropy: bool = False,
        chunk_size: int | None = None,
        temperature: float = 1.0,
        truncation: Truncation | None = None,
        micro_batch_size: int | None = None,
        return_routing: bool = False,
        topk: int = 0,
        gather_ids: torch.Tensor | None = None,
    ) -> ActionLogProbs:
        """Log-probs [B, A] of the response tokens of ``samples`` (padded or packed) and optionally entropy [B, A].

        ``vision_extra``: per-video inputs SamplesVL has no field for (``BuiltSamples.vision_extra``, e.g.
        Qwen2.5-VL's ``second_per_grid_ts``). ``temperature`` divides the logits (match the sampler's);
        ``truncation`` (the sampler's min-p / top-k / top-p) scores the distribution the engine sampled from, each
        token's kept set taken from THIS model's logits; tokens outside it come back flagged in ``outside``.
        The inputs may be anywhere (the CPU, where they are built): they are moved to this actor's device, where
        the outputs are. ``return_routing``: fill ``ActionLogProbs.routing`` (one forward: not with a
        ``micro_batch_size`` below the batch).

        Distillation over more than the sampled token (:mod:`mmrlhf.algorithms.distill_topk`): ``topk`` > 0 fills
        ``topk_log_probs`` / ``topk_ids`` [B, A, k] (a teacher's record, no gradient); ``gather_ids`` [B, A, k] (ids
        per response position, e.g. a teacher's top-k) fills ``gathered_log_probs`` [B, A, k], differentiable. Both
        come from the lm_head chunks the sampled tokens' log-probs are computed from (no [B, A, V] tensor).
        """
        check_wrapper_layout(self.model)
        chunk = chunk_size or self.chunk_size
        batch = samples.batch_size
        if isinstance(samples, GroupedSamples) and micro_batch_size is not None and micro_batch_size < batch:
            raise ValueError("a grouped (shared-prompt) batch is one forward: build one per micro-batch instead of "
                             "passing micro_batch_size")
        if return_routing:
            if micro_batch_size is not None and micro_batch_size < batch:
                raise ValueError("return_routing describes one forward: pass no micro_batch_size below the batch")
            with self._autocast():
                return self._forward_one(samples, vision_extra, return_entropy, chunk, temperature, truncation,
                                         return_routing=True, topk=topk, gather_ids=gather_ids)
        with self._autocast():
            return self._forward_groups(samples, vision_extra, return_entropy, chunk, temperature, truncation,
                                        micro_batch_size, topk, gather_ids)

    def _forward_groups(self, samples, vision_extra, return_entropy, chunk, temperature, truncation,
                        micro_batch_size, topk=0, gather_ids=None) -> ActionLogProbs:
        batch = samples.batch_size
        if micro_batch_size is None or micro_batch_size >= batch:
            return self._forward_one(samples, vision_extra, return_entropy, chunk, temperature, truncation,
                                     topk=topk, gather_ids=gather_ids)
        parts = []
        for s in range(0, batch, micro_batch_size):
            group = range(s, min(s + micro_batch_size, batch))
            ids = None if gather_ids is None else gather_ids[group.start:group.stop]  # this group's rows
            parts.append(self._forward_one(*select_samples(samples, vision_extra, group), return_entropy, chunk,
                                           temperature, truncation, topk=topk, gather_ids=ids))
        a_max = max(p.action_mask.shape[1] for p in parts)

        def cat(tensors):  # [b_i, A_i, ...] ... -> [B, A, ...]
            if tensors[0] is None:
                return None
            return torch.cat([pad_positions(t, a_max) for t in tensors], dim=0)

        return ActionLogProbs(
            cat([p.log_probs for p in parts]),
            cat([p.entropy for p in parts]) if return_entropy else None,
            cat([p.action_mask for p in parts]),
            cat([p.outside for p in parts]),
            None,
            cat([p.topk_log_probs for p in parts]),
            cat([p.topk_ids for p in parts]),
            cat([p.gathered_log_probs for p in parts]),
        )


def _per_position(flat: torch.Tensor | None, action_mask: torch.Tensor) -> torch.Tensor | None:
    """[N, k] values of the response tokens (action-mask order) -> [B, A, k], 0 off the mask (differentiable)."""
    if flat is None:
        return None
    out = flat.new_zeros(*action_mask.shape, flat.shape[-1])  # [B, A, k]
    out[action_mask] = flat
    return out


def select_samples(
    samples: SamplesVL, vision_extra: dict[str, torch.Tensor] | None, indices: range
) -> tuple[SamplesVL, dict[str, torch.Tensor] | None]:
    """A contiguous group of samples as its own SamplesVL (same layout) + its slice of ``vision_extra``."""
    i0, i1 = indices.start, indices.stop
    batch = samples.batch_size
    image_num = samples.image_num or [0] * batch
    video_num = samples.video_num or [0] * batch
    vision = split_vision_inputs(image_num, video_num, samples.pixel_values, samples.image_grid_thws,
                                 samples.pixel_values_videos, samples.video_grid_thws)[i0:i1]

    def join(key):
        parts = [v[key] for v in vision if key in v]
        return torch.cat(parts, dim=0) if parts else None

    v0, v1 = sum(video_num[:i0]), sum(video_num[:i1])
    extra = {k: t[v0:v1] for k, t in (vision_extra or {}).items()} or None
    common = dict(
        response_length=samples.response_length[i0:i1], total_length=samples.total_length[i0:i1],
        pixel_values=join("pixel_values"), image_grid_thws=join("image_grid_thw"),
        pixel_values_videos=join("pixel_values_videos"), video_grid_thws=join("video_grid_thw"),
        image_num=image_num[i0:i1], video_num=video_num[i0:i1],
    )
    if samples.packed:
        lens = samples.packed_seq_lens
        t0, t1 = int(lens[:i0].sum()), int(lens[:i1].sum())
        sub = SamplesVL(
            sequences=samples.sequences[:, t0:t1], attention_mask=samples.attention_mask[:, t0:t1] - i0,
            action_mask=None if samples.action_mask is None else samples.action_mask[i0:i1], num_actions=torch.as_tensor(samples.num_actions)[i0:i1],
            packed_seq_lens=lens[i0:i1], mm_token_type_ids=samples.mm_token_type_ids[:, t0:t1],
            routed_experts=None if samples.routed_experts is None else samples.routed_experts[:, t0:t1], **common,
        )
    else:
        sub = SamplesVL(
            sequences=samples.sequences[i0:i1], attention_mask=samples.attention_mask[i0:i1],
            action_mask=samples.action_mask[i0:i1], num_actions=samples.num_actions, packed_seq_lens=None,
            mm_token_type_ids=samples.mm_token_type_ids[i0:i1],
            routed_experts=None if samples.routed_experts is None else samples.routed_experts[i0:i1], **common,
        )
    return sub, extra
