"""The turn loop: multi-turn, tool-using generation over a rollout engine, token in, token out.

A trajectory's turn goes to the engine as its ids so far plus every image so far; the first turn asks for ``n``
completions per prompt (a group shares its first prompt), later turns one per trajectory. Between turns the
policy's calls are parsed strictly, run under a deadline (:class:`~mmrlhf.agents.runner.ToolRunner`), and their
results appended as observation tokens (:class:`~mmrlhf.agents.template.ObservationRenderer`), each returned image
encoded once by the processor (pixel values and ``grid_thw`` kept with the trajectory, never re-processed).

Two drivers run these turns (``agent.loop``): the asynchronous one (:mod:`mmrlhf.agents.async_loop`, what ``auto``
picks over a vLLM engine whose stream has run on this kind of machine: :func:`~mmrlhf.rollout.streaming.auto_loop`)
sends each trajectory's next turn as soon as its observation is ready, into the engine's continuous batch; the
lockstep one (:mod:`mmrlhf.agents.lockstep`) waits for every trajectory of a wave at every turn. This module holds
what a trajectory does at each turn, which both share. Both sample the same trajectories where the engine's results
do not depend on which requests share its batch (float32 on the CPU: exact); on a GPU in bf16 a request's logits
move with its batch by bf16 rounding, so a trajectory may part from its lockstep twin at a near-tie token (``mmrlhf
doctor --gpu`` measures how often) unless vLLM runs batch-invariant (``VLLM_BATCH_INVARIANT=1``).

Invariants (each checked or built in):

- the engine's ids are the truth: a turn's tokens are appended as sampled and never decoded and re-encoded; each
  request's ids are the previous request's ids plus the turn plus the observation (append-only);
- a turn is sampled from a seed of its trajectory and turn number (group and turn for the shared first turn), with
  a token cap of its own, so its tokens never depend on which other trajectories share its engine call or when
  it is sent;
- policy tokens (mask 1) carry the engine's log-probs; observation tokens (mask 0) are attended to, never trained;
- an observation is committed only if it fits the context budget with room for one more token, so ids and pixels
  never disagree and no image is ever cut (its failures are counted either way);
- a result's text is data: escaped into plain text ids (:mod:`mmrlhf.agents.plain_text`), it can never hold a
  marker of the template, a vision token or a call the parser would read (only the policy's own turns are parsed);
- every failure (malformed call, unknown tool, bad arguments, a tool that raises or hangs, an oversize image, a
  budget) is an observation the model can learn from or a marked ending, counted in :attr:`AgentResult.metrics`;
  nothing is dropped silently.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Sequence

import torch

from mmrlhf.agents.calls import parse_turn
from mmrlhf.agents.environment import EnvironmentSpecError, FailedEnvironment
from mmrlhf.agents.async_loop import AsyncTurns
from mmrlhf.agents.live import LiveTrajectory
from mmrlhf.agents.lockstep import Lockstep
from mmrlhf.agents.loop_types import AgentLimits, AgentResult, AgentSample, ImageEncoder, LoopStats
from mmrlhf.agents.runner import ToolRunner
from mmrlhf.agents.template import ObservationRenderer
from mmrlhf.agents.types import FailedStep, ToolCall, ToolContext, ToolResult, Trajectory, TurnRecord
from mmrlhf.rollout.streaming import auto_loop
from mmrlhf.rollout.types import GenerationRequest, SamplingSettings, mix_seed, request_seed

logger = logging.getLogger(__name__)

CALL_CLOSE = "</tool_call>"  # Qwen's hermes closing tag: a turn that makes calls ends here


class AgentLoop:
    """Runs the turns of one step's trajectories.

    Args:
        engine: a :class:`~mmrlhf.rollout.base.RolloutEngine`.
        tokenizer: the policy's tokenizer (decoding turns for parsing and rewards; never re-encoding them).
        adapter: the family's :class:`~mmrlhf.models.adapters.FamilyAdapter`.
        encode_images: the :data:`ImageEncoder` (the data processor's).
        limits: :class:`AgentLimits`.
        eos_ids: ids that end a turn (the tokenizer's and the model's EOS ids).
        tools: name -> :class:`~mmrlhf.agents.tools.Tool` (tool mode), or
        environment: a factory of one environment per trajectory (environment mode).
        runner: the :class:`~mmrlhf.agents.runner.ToolRunner` (deadlines, concurrency, image size limit).
    """

    def __init__(self, engine: Any, tokenizer: Any, adapter: Any, encode_images: ImageEncoder, limits: AgentLimits,
                 eos_ids: Sequence[int], runner: ToolRunner, *, tools: dict[str, Any] | None = None,
                 environment: Callable[[], Any] | None = None) -> None:
        if (tools is None) == (environment is None):
            raise ValueError("an agent loop needs either tools or an environment")
        self._auto: tuple[str, str] | None = None  # agent.loop=auto's choice over this engine, and why (logged once)
        self.engine = engine
        self.tokenizer = tokenizer
        self.adapter = adapter
        self.encode_images = encode_images
        self.limits = limits
        self.runner = runner
        self.tools = tools
        self.environment = environment
        self.renderer = ObservationRenderer(tokenizer, adapter)
        call_close = tokenizer.convert_tokens_to_ids(CALL_CLOSE)
        unk = getattr(tokenizer, "unk_token_id", None)
        self.call_close_id = None if call_close is None or call_close == unk else int(call_close)
        if tools is not None and limits.stop_at_tool_call and self.call_close_id is None:
            raise ValueError("agent.stop_at_tool_call: the tokenizer has no '</tool_call>' token; set it to false")
        # the closing tag as a stop string too (a tokenizer may hold it inside a larger token); off for segmented
        # turns, where the engine writes on past such a token and the loop drops what follows the call
        self.call_stop_string = True
        self.stop_ids = set(map(int, eos_ids))
        if tools is not None and limits.stop_at_tool_call:
            self.stop_ids.add(self.call_close_id)

    def use_segmented(self, engine: Any) -> None:
        """Generate through ``engine`` from now on: a :class:`~mmrlhf.rollout.partial.SegmentedEngine`
        (``rollout.partial``; a rollout actor calls this), each turn in segments with updates applied between them,
        every token versioned. The turns then run lockstep whatever ``agent.loop`` says: a checkpoint regenerates an
        in-flight batch by the version of each engine call's segments, so its calls must come out the same when
        regenerated, and only lockstep calls are independent of the tools' timing."""
        if self.limits.loop == "async":
            logger.info("rollout.partial: the agent turns run lockstep (agent.loop=async is not replayable from a "
                        "checkpoint's segment versions)")
        self.engine = engine
        self._auto = None
        self.limits = dataclasses.replace(self.limits, loop="lockstep")
        # a stop string could straddle a segment boundary (refused there); the closing tag's own token still stops
        # a turn, and what an engine writes past a call inside a larger token is dropped (_append_turn)
        self.call_stop_string = False

    def driver(self) -> str:
        """The loop that runs the turns: ``agent.loop``, with ``auto`` resolved by the engine
        (:func:`~mmrlhf.rollout.streaming.auto_loop`: ``async`` where it keeps a continuous batch whose stream has
        run on this kind of machine), decided and logged once per engine."""
        if self.limits.loop != "auto":
            return self.limits.loop
        if self._auto is None:
            self._auto = auto_loop(self.engine)
            logger.info("agent.loop=auto: %s (%s)", *self._auto)
        return self._auto[0]

    # ---- the loop ----------------------------------------------------------------------------------------------
    def run(self, batch: Any, n: int, sampling: SamplingSettings, contexts: Sequence[ToolContext]) -> AgentResult:
        """Trajectories of every sample of ``batch`` (a processed, n-expanded batch: sample ``k`` belongs to prompt
        ``k // n``); ``contexts`` one per unique prompt (copied per trajectory, each with its own ``state``).

        ``limits.loop`` picks the driver; ``limits.max_concurrent_trajectories`` bounds the live trajectories (whole
        groups, one group at least): a pool refilled as trajectories end (async) or waves (lockstep). The
        trajectories are the same either way (each turn's seed is its trajectory's)."""
        seconds = {"generate": 0.0, "tools": 0.0}
        stats = LoopStats()
        start = time.perf_counter()
        driver = AsyncTurns if self.driver() == "async" else Lockstep
        everyone, skipped = driver(self, sampling, stats, seconds, start).run(batch, n, contexts)
        # A trajectory the budget ended before its first turn (an environment's first observation that does not
        # fit) has nothing to train: left out, counted and logged, never silently.
        empty = [t for t in everyone if t.group not in skipped and not any(t.mask)]
        if empty:
            logger.warning("%d trajectories ended before their first turn (first: sample %d, %s); left out of the "
                           "step", len(empty), empty[0].sample_index, empty[0].ended)
        stats.empty = len(empty)
        kept = [t for t in everyone if t.group not in skipped and any(t.mask)]
        samples = [self._finish(t) for t in kept]
        stats.trajectory_seconds = [t.ended_at if t.ended_at is not None else time.perf_counter() - start
                                    for t in kept]
        stats.tool_wait = [t.tool_wait for t in kept]
        stats.engine_busy = seconds["generate"] / max(time.perf_counter() - start, 1e-9)
        return AgentResult(samples, skipped, stats.generated, stats.metrics(samples), seconds)

    def _start(self, batch: Any, k: int, n: int, context: ToolContext, env: Any = None) -> LiveTrajectory:
        """Trajectory ``k`` before its first turn, with its own copy of the prompt's context and an environment
        (``env``, one reused from a pool, or a new one from the factory)."""
        ctx = dataclasses.replace(context, images=list(context.images), videos=list(context.videos),
                                  model_image_sizes=list(context.model_image_sizes), state={}, trajectory_index=k)
        return LiveTrajectory(sample_index=k, group=k // n, prompt_ids=list(batch.all_prompt_token_ids[k]),
                     vision=dict(batch.all_vision_inputs[k]), images=list(batch.all_images[k]), context=ctx,
                     env=env if env is not None else self._new_environment(k))

    def _new_environment(self, k: int) -> Any:
        """Trajectory ``k``'s environment; a factory that raises gives a :class:`FailedEnvironment` (logged, counted
        as the trajectory's ``tool_raised``). Ctrl-C (this is the rollout's thread) and a spec error still raise."""
        if self.environment is None:
            return None
        try:
            return self.environment()
        except (KeyboardInterrupt, EnvironmentSpecError):
            raise
        except BaseException as exc:  # noqa: BLE001 - user code; SystemExit included: counted, never the run's end
            logger.warning("trajectory %d: the environment factory raised %s", k, type(exc).__name__, exc_info=exc)
            detail = f": {exc}" if str(exc) else ""
            return FailedEnvironment(f"Error: the environment could not be created ({type(exc).__name__}"
                                     f"{detail})"[:500])

    def _request(self, t: LiveTrajectory, seed: int | None) -> GenerationRequest:
        """The trajectory so far as a request: its ids (the engine takes them as they are: never re-tokenised),
        every image so far, with their processor tensors (the transformers engine reads those), and its own seed."""
        ids = t.ids
        if self.adapter.engine_prompt_ids(ids) is None:
            raise ValueError(
                f"record {t.context.record.get('id')!r}: a multi-turn rollout sends the engine token ids, and the "
                f"{self.adapter.family} family's prompts with videos can only be sent as text (their expansion "
                "interleaves timestamps with the pads); use image inputs for this family's agent runs")
        return GenerationRequest(
            prompt="", prompt_token_ids=ids, images=list(t.images), vision_inputs=self._vision(t),
            mm_token_type_ids=list(self.adapter.mm_token_type_ids(ids)),
            request_id=f"{t.context.record.get('id')}#{t.sample_index}",  # record id, then the trajectory
            seed=seed)

    @staticmethod
    def _seed(sampling: SamplingSettings, turn: int, index: int, n: int) -> int | None:
        """The seed of turn ``turn`` of trajectory ``index`` (turn 0: of group ``index``, whose ``n`` trajectories
        draw from it ``+ j``). Why per trajectory and turn, not per engine call: a turn's tokens then depend on the
        step's seed and the trajectory alone, never on which other trajectories share its call (the calls are
        grouped by token cap, and a loop that does not wait for the others groups them by timing)."""
        return None if sampling.seed is None else request_seed(mix_seed(sampling.seed, turn), index, n)

    def _check_echo(self, t: LiveTrajectory, engine_ids: Sequence[int]) -> None:
        """The engine must have seen exactly the trajectory's ids (vision pads expanded as the processor expands
        them): a difference means the engine's vision expansion or an image count disagrees with the trainer's,
        and every later log-prob would be scored on another sequence."""
        ids = t.ids
        if list(engine_ids) != ids:
            pos = next((i for i, (a, b) in enumerate(zip(engine_ids, ids)) if a != b), min(len(ids), len(engine_ids)))
            raise ValueError(
                f"record {t.context.record.get('id')!r}, trajectory {t.sample_index}, turn {t.num_turns + 1}: the "
                f"engine's prompt ids differ from the trajectory's at position {pos} ({len(engine_ids)} vs {len(ids)} "
                "tokens): its vision expansion or image count disagrees with the processor's")

    def _cap(self, t: LiveTrajectory) -> int:
        """The new-token cap of ``t``'s next turn: the per-turn cap where the context leaves room for it, else the
        largest power of two that fits (the lockstep loop groups its requests by it: few calls, never past the
        budget; the asynchronous loop uses the same cap, so both sample the same turns)."""
        cap = self.limits.max_new_tokens_per_turn
        room = max(1, self.limits.max_context_tokens - len(t.ids))
        return cap if room >= cap else 1 << (room.bit_length() - 1)

    @property
    def _stops_at_calls(self) -> bool:
        return self.tools is not None and self.limits.stop_at_tool_call

    def _settings(self, sampling: SamplingSettings, *, n: int, room: int) -> SamplingSettings:
        """A turn's sampling: the run's, with ``n``, the turn's new-token cap and, when turns end at their calls, the
        closing tag as a stop token (and as a stop string, for a tokenizer that holds it inside a larger token)."""
        stops, words = set(sampling.stop_token_ids), tuple(sampling.stop)
        if self._stops_at_calls:
            stops.add(self.call_close_id)
            if self.call_stop_string:
                words = tuple(dict.fromkeys(words + (CALL_CLOSE,)))
        return dataclasses.replace(sampling, n=n, max_new_tokens=max(1, room), stop_token_ids=tuple(sorted(stops)),
                                   stop=words, min_new_tokens=min(sampling.min_new_tokens, max(1, room)))

    def _append_turn(self, t: LiveTrajectory, completion: Any, stats: LoopStats) -> None:
        """Append a turn as sampled, through its first stop token (or, when turns end at their calls, the token that
        closes the first call: what an engine wrote past it is dropped, never trained)."""
        tokens = list(completion.token_ids)
        cut = next((j + 1 for j, tok in enumerate(tokens) if tok in self.stop_ids), None)
        tokens = tokens[:cut] if cut is not None else tokens
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        if self._stops_at_calls and CALL_CLOSE in text:
            cut = self._call_end(tokens)  # the turn ends with its call (never "length")
            if cut < len(tokens):  # the engine wrote past the call's closing tag: dropped
                tokens = tokens[:cut]
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        self._version(t, completion.token_versions, len(tokens))
        t.response.extend(tokens)
        t.mask.extend([1] * len(tokens))
        if t.logprobs is not None and completion.logprobs is not None:
            t.logprobs.extend(float(x) for x in completion.logprobs[: len(tokens)])
        else:
            t.logprobs = None
        stats.generated += len(tokens)
        self._route(t, completion.routed_experts)
        t.turns.append(TurnRecord(role="assistant", text=text))
        t.last_text = text
        if cut is None and completion.truncated:
            t.ended = "length"

    @staticmethod
    def _version(t: LiveTrajectory, versions: Sequence[int] | None, kept: int) -> None:
        """Record the policy version of each of a turn's ``kept`` tokens (``rollout.partial``: a turn generated in
        segments may span an update); the observations before it (not yet versioned) take the version of the turn
        before them."""
        if versions is None:
            if t.versions is not None:
                raise ValueError(f"trajectory {t.sample_index}: a turn came back without token versions after "
                                 "turns with them")
            return
        if t.versions is None:
            t.versions = []
        last = t.versions[-1] if t.versions else int(versions[0]) if len(versions) else 0
        t.versions.extend([last] * (len(t.response) - len(t.versions)))  # the observations since the last turn
        t.versions.extend(int(v) for v in versions[:kept])

    @staticmethod
    def _route(t: LiveTrajectory, routed: Any) -> None:
        """Stitch a turn's routed experts onto ``t``'s (``rollout.routing_replay``): the turn's request ran the
        trajectory so far (its earlier rows are the earlier turns', kept as they were when sampled) and then its own
        tokens; only its new rows are added, cut to the ids the trajectory kept (a call's tail dropped)."""
        if routed is None:
            if t.routed is not None:
                raise ValueError(f"trajectory {t.sample_index}: a turn came back without routed experts after "
                                 "turns with them")
            return
        rows = torch.as_tensor(routed).to(torch.int16)  # [prompt + turn - 1, L, k]
        have = 0 if t.routed is None else t.routed.shape[0]
        merged = rows if t.routed is None else torch.cat([t.routed, rows[have:]], dim=0)
        t.routed = merged[: len(t.ids)]

    def _call_end(self, tokens: list[int]) -> int:
        """Length of the shortest prefix of ``tokens`` whose text holds a closing call tag (the caller has seen
        that the whole turn's text does)."""
        lo, hi = 1, len(tokens)  # the shortest prefix containing the tag: binary search over prefix lengths
        while lo < hi:
            mid = (lo + hi) // 2
            if CALL_CLOSE in self.tokenizer.decode(tokens[:mid], skip_special_tokens=True):
                hi = mid
            else:
                lo = mid + 1
        return lo

    # ---- observations ------------------------------------------------------------------------------------------
    def _plan(self, t: LiveTrajectory, jobs: list[tuple[ToolCall, ToolContext]]) -> list[tuple[str, Any]] | None:
        """Parse ``t``'s last turn: None when it ended the trajectory (an answer, the turn budget), else its
        observation's items in text order, ``("job", index into jobs)`` for a call to run (appended to ``jobs``) or
        ``("result", ToolResult)`` for a parse error answered as it is."""
        parsed = parse_turn(t.last_text, self.tools, remaining_calls=self.limits.max_tool_calls - t.calls)
        t.turns[-1].calls = list(parsed.calls)
        if parsed.is_final:
            t.ended = "answer"
            return None
        if t.num_turns >= self.limits.max_turns:
            t.ended = "max_turns"
            return None
        items = []
        for kind, item in _ordered(parsed):
            if kind == "call":
                items.append(("job", len(jobs)))
                jobs.append((item, t.context))
                t.calls += 1
            else:
                items.append(("result", item))
        return items

    def _answer(self, t: LiveTrajectory, items: list[tuple[str, Any]], jobs: list[tuple[ToolCall, ToolContext]],
                ran: list[tuple[ToolResult, float]], stats: LoopStats) -> None:
        """Commit the observation of ``t``'s planned items, the calls answered by ``ran`` (in ``jobs`` order)."""
        results, latency = [], 0.0
        for kind, value in items:
            if kind == "job":
                result, sec = ran[value]
                stats.latency.append(sec)
                stats.calls_by_tool[jobs[value][0].name] = stats.calls_by_tool.get(jobs[value][0].name, 0) + 1
                latency = max(latency, sec)
                results.append(result)
            else:
                results.append(value)
        self._commit(t, results, latency, stats, environment=False)

    def _may_step(self, t: LiveTrajectory) -> bool:
        """Whether ``t``'s environment answers its last turn (else the turn budget ended it)."""
        if t.num_turns >= self.limits.max_turns:
            t.ended = "max_turns"
            return False
        return True

    def _stepped(self, t: LiveTrajectory, step: Any, sec: float, stats: LoopStats) -> None:
        """Take the environment's answer ``step`` (after ``sec`` seconds) to ``t``'s last turn; a failed one
        (:class:`~mmrlhf.agents.types.FailedStep`) ends the episode and marks the environment unclean."""
        stats.latency.append(sec)
        if isinstance(step, FailedStep):
            t.env_clean = False
        t.info.update(step.info or {})
        if step.done:  # the episode is over: its last observation is not shown, a failure still counted
            t.ended = "done"
            if step.observation.error is not None:
                stats.errors[step.observation.error] = stats.errors.get(step.observation.error, 0) + 1
                t.turns.append(TurnRecord(role="tool", text=step.observation.text,
                                          errors=[step.observation.error], latency_s=sec))
            return
        self._commit(t, [step.observation], sec, stats, environment=True)

    def _was_reset(self, t: LiveTrajectory, first: Any, sec: float, stats: LoopStats) -> None:
        """Take ``t``'s environment's ``reset`` answer (after ``sec`` seconds): its first observation, if it gives
        one, comes before the first turn (which is then generated per trajectory).

        A reset that failed or timed out (:class:`~mmrlhf.agents.types.FailedStep`) ends the trajectory before its
        first turn, ``reset_failed`` (counted, and its failure by kind), and marks the environment unclean: its
        error is never shown as the record's opening, and no step runs on an episode that did not start (a reused
        environment's would still be the previous record's). A reset that says ``done`` (no episode for this
        record) ends it too, ``done``. Either way the trajectory has no turn, so it is left out of the step
        (``agent/ended/before_first_turn``)."""
        stats.latency.append(sec)
        if first is None:
            return
        t.info.update(first.info or {})
        if isinstance(first, FailedStep):
            t.env_clean = False
            t.ended = "reset_failed"
            stats.reset_failed += 1
            kind = first.observation.error or "tool_raised"
            stats.errors[kind] = stats.errors.get(kind, 0) + 1
            t.turns.append(TurnRecord(role="tool", text=first.observation.text, errors=[kind], latency_s=sec))
            logger.warning("trajectory %s (record %r): its environment's reset failed (%s); it ends before its first "
                           "turn", t.sample_index, t.context.record.get("id"), first.observation.text[:200])
            return
        if first.done:
            t.ended = "done"
            return
        self._commit(t, [first.observation], sec, stats, environment=True, opening=True)

    def _commit(self, t: LiveTrajectory, results: list[ToolResult], latency: float, stats: LoopStats, *, environment: bool,
                opening: bool = False) -> None:
        """Encode the results' images (capped), build the observation's tokens, append it if it fits."""
        results = self._cap_images(t, results)
        try:
            encoded = [self.encode_images(list(r.images)) if r.images else [] for r in results]
        except ValueError as exc:  # an image the processor cannot take: answered as an error, never a crash
            logger.warning("trajectory %s: a tool image could not be encoded: %s", t.sample_index, exc)
            results = [ToolResult(text=f"Error: the returned image could not be used: {exc}", error="tool_raised")
                       if r.images else r for r in results]
            encoded = [[] for _ in results]
        close = not opening and not (t.response and self.renderer.ends_turn(t.response[-1]))
        counts = [e.tokens for enc in encoded for e in enc]
        obs = self.renderer.tokens(results, counts, close_turn=close, environment=environment)
        errors = [r.error for r in results if r.error is not None]
        for e in errors:  # counted whether or not the observation fits: a failure is never lost
            stats.errors[e] = stats.errors.get(e, 0) + 1
        text = "\n".join(r.text for r in results if r.text)
        if len(t.ids) + len(obs) + 1 > self.limits.max_context_tokens:
            t.ended = "context"  # not committed: ids and pixels stay in agreement
            t.turns.append(TurnRecord(role="tool", text=text, errors=errors, latency_s=latency))  # not shown
            return
        stats.escaped += sum(self.renderer.escapes(r) for r in results)
        t.response.extend(obs)
        t.mask.extend([0] * len(obs))
        if t.logprobs is not None:
            t.logprobs.extend([0.0] * len(obs))
        stats.observation_tokens += len(obs)
        for r, enc in zip(results, encoded):
            for original, e in zip(r.images, enc):
                t.images.append(e.image)  # as the model sees it (the engine gets this one)
                t.tool_pixels.append(e.pixel_values)
                t.tool_grids.append(e.grid_thw)
                # later calls crop the image as the tool returned it (full resolution), boxes in the model's size
                t.context.images.append(original)
                grid = e.grid_thw.reshape(-1)
                patch = self.adapter.patch_size
                t.context.model_image_sizes.append((int(grid[2]) * patch, int(grid[1]) * patch))
        t.turns.append(TurnRecord(role="tool", text=text,
                                  images=[im for enc in encoded for im in (e.image for e in enc)], errors=errors,
                                  latency_s=latency))

    def _cap_images(self, t: LiveTrajectory, results: list[ToolResult]) -> list[ToolResult]:
        """Results whose images would take the trajectory past ``max_images`` become ``too_many_images`` errors."""
        have, out = len(t.images), []
        for r in results:
            if r.images and have + len(r.images) > self.limits.max_images:
                out.append(ToolResult(text=f"Error: this trajectory may hold at most {self.limits.max_images} "
                                           "images; the result's images were not added.", error="too_many_images"))
                continue
            have += len(r.images)
            out.append(r)
        return out

    # ---- results -----------------------------------------------------------------------------------------------
    def _vision(self, t: LiveTrajectory) -> dict[str, torch.Tensor]:
        """The prompt's vision tensors with the tool images appended (image order = pad order in the ids)."""
        if not t.tool_pixels:
            return dict(t.vision)
        out = dict(t.vision)
        parts = ([t.vision["pixel_values"]] if "pixel_values" in t.vision else []) + t.tool_pixels
        grids = ([t.vision["image_grid_thw"]] if "image_grid_thw" in t.vision else []) + t.tool_grids
        out["pixel_values"] = torch.cat(parts, dim=0)  # [rows of every image, D]
        out["image_grid_thw"] = torch.cat([g.reshape(-1, 3) for g in grids], dim=0)  # [images, 3]
        return out

    def _finish(self, t: LiveTrajectory) -> AgentSample:
        ended = t.ended or "answer"
        trajectory = Trajectory(turns=t.turns, final_answer=t.last_text, ended=ended, info=t.info)
        return AgentSample(
            sample_index=t.sample_index, group=t.group, prompt_ids=t.prompt_ids, response_ids=t.response,
            policy_mask=t.mask, engine_logprobs=t.logprobs, finished=ended in ("answer", "done"),
            vision=self._vision(t), images=t.images, trajectory=trajectory, routed_experts=t.routed,
            token_versions=None if t.versions is None else
            t.versions + (t.versions[-1:] or [0]) * (len(t.response) - len(t.versions)))


def _ordered(parsed: Any) -> list[tuple[str, Any]]:
    """The parsed turn's calls (``("call", ToolCall)``) and parse errors (``("error", ToolResult)``) in the order
    they appear in the text."""
    return [("call", item) if isinstance(item, ToolCall) else ("error", item) for item in parsed.items()]
