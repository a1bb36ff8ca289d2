"""The one config tree of the framework. Each section lives in its own module and is owned by its subsystem;
builders hand sections (or plain values taken from them) to constructors, never the whole tree."""

from __future__ import annotations

from pydantic import Field, model_validator

from mmrlhf.config.agent import AgentConfig
from mmrlhf.config.algorithm import AlgorithmConfig
from mmrlhf.config.base import Section
from mmrlhf.config.data import DataConfig
from mmrlhf.config.distributed import DistributedConfig
from mmrlhf.config.model import ModelConfig
from mmrlhf.config.reward import RewardConfig
from mmrlhf.config.rollout import RolloutConfig
from mmrlhf.config.trainer import TrainerConfig


class MMRLHFConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Prompt data."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation engine and sampling."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward sources and recipes."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantages, KL, losses."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Training loop."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Launch mode (single process, torchrun + FSDP2, Ray) and asynchronous training."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """Multi-turn, tool-using rollouts (off unless tools or an environment are given)."""

    @model_validator(mode="after")
    def _check_precision(self) -> "MMRLHFConfig":
        """``model.dtype`` is the one source of truth of the compute dtype; ``distributed.mixed_precision`` may only
        repeat it."""
        implied = {"float32": "none", "bfloat16": "bf16", "float16": "fp16"}[self.model.dtype]
        mp = self.distributed.mixed_precision
        if mp not in ("auto", implied):
            raise ValueError(f"distributed.mixed_precision={mp} contradicts model.dtype={self.model.dtype}: "
                             "model.dtype names the compute dtype in every launch mode (float32 master weights "
                             "below it); set model.dtype to the precision you want and distributed.mixed_precision="
                             "auto")
        return self

    @model_validator(mode="after")
    def _check_teacher(self) -> "MMRLHFConfig":
        """Distillation (the advantage, the loss term or both) needs a teacher, and a teacher without distillation
        would be loaded for nothing."""
        a = self.algorithm
        for key in ("distill_coef", "distill_loss_coef"):
            if getattr(a, key) > 0 and not self.model.teacher:
                raise ValueError(f"algorithm.{key} > 0 needs model.teacher (the path of the teacher model)")
        if self.model.teacher and not a.distilling:
            raise ValueError("model.teacher is set but algorithm.distill_coef and algorithm.distill_loss_coef are 0: "
                             "the teacher would never be read; set one > 0 or remove model.teacher")
        return self

    @model_validator(mode="after")
    def _check_rollout_kind(self) -> "MMRLHFConfig":
        """The built-in kinds and the ``agent`` section must agree: the turn loop needs tools or an environment, and
        tools configured for a single-turn rollout would sit in every prompt unused."""
        kind, agent = self.rollout.kind, self.agent.enabled
        if kind == "agent" and not agent:
            raise ValueError("rollout.kind=agent needs agent.tools or agent.environment (the turn loop has nothing "
                             "to call); set one, or rollout.kind=auto")
        if kind == "single_turn" and agent:
            raise ValueError("rollout.kind=single_turn contradicts agent.tools / agent.environment (a single "
                             "generation never calls them); set rollout.kind=auto or agent, or remove the agent "
                             "section")
        return self

    @model_validator(mode="after")
    def _check_routing_replay(self) -> "MMRLHFConfig":
        """Routing replay needs the vLLM engine (the transformers engine IS the actor's module: nothing to replay)."""
        if self.rollout.routing_replay == "none":
            return self
        if self.rollout.engine != "vllm":
            raise ValueError(f"rollout.routing_replay={self.rollout.routing_replay} needs rollout.engine=vllm (the "
                             "transformers engine generates with the actor's own module: it routes as the trainer)")
        return self

    @model_validator(mode="after")
    def _check_partial(self) -> "MMRLHFConfig":
        """Partial rollouts only have a meaning where updates arrive during a generation, and only continue what a
        segment boundary cannot break."""
        r, d = self.rollout, self.distributed
        if not r.partial:
            return self
        if d.backend != "ray" or d.max_staleness < 1:
            raise ValueError("rollout.partial=true needs the asynchronous Ray mode (distributed.backend=ray and "
                             f"distributed.max_staleness >= 1; got backend={d.backend}, max_staleness="
                             f"{d.max_staleness}): elsewhere no weight update arrives while a batch is generated")
        if r.stop:
            raise ValueError(f"rollout.partial=true with rollout.stop={r.stop}: a stop string that straddles a "
                             "segment boundary would not be matched (EOS is); remove rollout.stop or set rollout.partial=false")
        if r.routing_replay != "none":
            raise ValueError(f"rollout.partial=true with rollout.routing_replay={r.routing_replay}: a continued "
                             "answer's routing would cover its last segment only; set one of them off")
        return self

    @model_validator(mode="after")
    def _check_offload(self) -> "MMRLHFConfig":
        """The transformers engine generates with the actor's module: with ``distributed.offload`` its parameters are
        host-memory shards that only FSDP2's forward gathers, never ``generate``."""
        if self.distributed.offload != "none" and self.rollout.engine == "transformers":
            raise ValueError(f"distributed.offload={self.distributed.offload} with rollout.engine=transformers: that "
                             "engine generates with the actor's own module, whose parameters would be host-memory "
                             "shards; use rollout.engine=vllm, or distributed.offload=none")
        return self

    @model_validator(mode="after")
    def _check_sleep_level(self) -> "MMRLHFConfig":
        if self.rollout.enable_sleep and self.rollout.sleep_level == 2 and self.model.lora.rank > 0:
            raise ValueError(
                "rollout.sleep_level=2 discards the engine's weights on every sleep, and with model.lora.rank > 0 the "
                "weight sync sends only the LoRA adapters (or the adapted layers), never the base weights: use "
                "rollout.sleep_level=1")
        return self

    @model_validator(mode="after")
    def _check_token_budget(self) -> "MMRLHFConfig":
        budget, a = self.trainer.max_tokens_per_micro_batch, self.algorithm
        if isinstance(budget, int) and a.loss_agg == "seq-mean-token-sum-norm" and a.loss_agg_norm_len is None:
            raise ValueError(
                f"trainer.max_tokens_per_micro_batch={budget} with algorithm.loss_agg=seq-mean-token-sum-norm needs "
                "algorithm.loss_agg_norm_len: without it each response's loss is divided by its micro-batch's padded "
                "length, which a token budget changes (set loss_agg_norm_len, e.g. to rollout.max_new_tokens, or "
                "trainer.max_tokens_per_micro_batch to auto or null)")
        return self
