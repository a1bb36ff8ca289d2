"""``trainer``: optimisation and bookkeeping of the training loop (``mmrlhf train``)."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from mmrlhf.config.base import Section
from mmrlhf.config.budget import check_budget


class TrainerConfig(Section):
    """Read by ``mmrlhf train`` (``mmrlhf.trainer``). A rollout step generates ``rollout_batch_size`` prompts x
    ``rollout.n_samples_per_prompt`` samples, then makes ``ppo_epochs x samples / train_batch_size`` optimiser
    steps on them."""

    # ---- optimisation ----------------------------------------------------------------------------------------
    lr: float = Field(default=1e-6, gt=0.0)
    """Actor learning rate (AdamW)."""
    lr_scheduler: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warm-up (cosine / linear decay to ``min_lr_ratio * lr`` at the last step)."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up, in OPTIMISER steps."""
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    """Final learning rate of the cosine / linear schedules, as a fraction of ``lr``."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay (not applied to 1-D parameters: norms and biases)."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_eps: float = Field(default=1e-8, gt=0.0)
    """AdamW epsilon."""
    max_grad_norm: float = Field(default=1.0, gt=0.0)
    """Gradient clipping norm (per optimiser step)."""
    critic_lr: float = Field(default=1e-5, gt=0.0)
    """Critic learning rate (PPO with ``algorithm.advantage_estimator: gae``)."""
    freeze_vision_tower: bool = True
    """Keep the vision tower's weights fixed (its merger excluded: see ``freeze_merger``)."""
    freeze_merger: bool = False
    """Also keep the vision merger (the projection of vision features into the language model) fixed."""
    max_consecutive_nonfinite: int = Field(default=5, ge=1)
    """A non-finite loss or gradient skips that optimiser step (logged, counted); this many in a row stop the run."""
    gradient_checkpointing: bool = False
    """Activation checkpointing of the policy and the critic in the updates: each transformer block keeps only its
    input and recomputes its activations in the backward (one extra forward of the decoder per micro-batch, about a
    third more update time; the activation memory of the blocks' insides is saved: docs/training.md). Every launch mode
    (one process, torchrun's FSDP2 shards, Ray trainer actors) and LoRA; the vision tower's blocks only when they
    train (``freeze_vision_tower=false`` or ``model.lora.vision``); no-grad forwards (scoring, generation) are
    untouched."""
    compute_copy: Union[Literal["auto"], bool] = "auto"
    """Where the policy and the critic keep float32 master weights and compute in bf16 under autocast (one process,
    Ray trainer actors; torchrun's FSDP2 casts its shards itself), hold a bf16 copy of their Linear weights for the
    whole optimiser step instead of autocast casting every weight again in every micro-batch's forward (and every
    recomputation): cast once per step, the same gradients bit for bit, added into float32 master gradients
    (mmrlhf/models/compute_copy.py; docs/training.md). ``auto``: on, except with ``gradient_checkpointing``, where
    autocast holds no copies for the backward and the step's copies would add their size (the lm_head and the
    decoder's Linear weights in bf16) to the peak; ``true`` then trades that memory for the casts."""

    # ---- batch sizes -----------------------------------------------------------------------------------------
    rollout_batch_size: int = Field(default=32, ge=1)
    """Prompts per rollout step (each sampled ``rollout.n_samples_per_prompt`` times)."""
    train_batch_size: int = Field(default=128, ge=1)
    """Samples per optimiser step (a mini-batch)."""
    micro_train_batch_size: int = Field(default=4, ge=1)
    """Samples per forward/backward pass (gradient accumulation fills ``train_batch_size`` exactly); with
    ``max_tokens_per_micro_batch: auto`` the reference the token budget is taken from."""
    max_tokens_per_micro_batch: Union[Literal["auto"], int, None] = "auto"
    """Token budget of one forward/backward of the policy and critic updates. A micro-batch's cost is the decoder
    positions its layout computes (padding included) plus the vision patch rows of its images and videos; samples
    are packed longest first into as few micro-batches as fit the budget (a sample larger than the budget runs
    alone, counted in ``policy/oversized_micro_batches``), prompt groups kept together where they fit, and with
    several ranks each rank deals its samples into the same number of micro-batches with balanced costs. An integer
    REPLACES ``micro_train_batch_size`` (a micro-batch holds as many samples as fit). ``auto``: per mini-batch the
    budget is the costliest micro-batch the count split of ``micro_train_batch_size`` would run, and that split is
    kept when the budget would not save a forward: never a higher peak, never more forwards. null: the count split.
    On by default because it is exact: every micro-batch loss is divided by its MINI-batch's count, so the
    gradient does not depend on which samples share a micro-batch (up to float32 summation order); the one
    exception, ``algorithm.loss_agg: seq-mean-token-sum-norm`` without ``algorithm.loss_agg_norm_len`` (it divides
    by each micro-batch's padded length), makes ``auto`` keep the count split and an integer an error."""
    ppo_epochs: int = Field(default=1, ge=1)
    """Passes over each rollout's samples (reshuffled into new mini-batches each pass)."""
    max_steps: int = Field(default=1000, ge=1)
    """Rollout steps to run."""
    packing_samples: bool = False
    """Pack sequences without padding in the forwards (works with images and video)."""
    shared_prompt: Union[Literal["auto"], bool] = "auto"
    """Shared-prompt forward: the samples of one prompt are scored as ONE row (the prompt and its images once, then
    each response attending to the prompt and itself only), in the experience forwards (actor, reference, critic)
    and the policy / value updates; results equal the per-sample layouts, the prompt's work is done once per group
    instead of once per sample. ``auto``: on when ``rollout.n_samples_per_prompt > 1`` and
    ``model.attn_implementation`` reads arbitrary masks (``sdpa``, ``eager``), except for multi-turn rollouts
    (``agent``), whose long responses make a group's dense row cost more than it saves; ``true`` turns it on
    there too, and refuses other kernels.
    With the count split (``max_tokens_per_micro_batch: null``) micro-batches are counted in samples: make
    ``micro_train_batch_size`` and ``rollout.micro_rollout_batch_size`` multiples of ``n_samples_per_prompt`` so
    that groups are not split across forwards; a token budget keeps each group in one forward where it fits."""
    shared_prompt_max_tokens: int = Field(default=8192, ge=1)
    """Longest row of the shared-prompt layout (prompt + responses); a group whose responses do not fit is split
    over several rows. Attention over a row is dense: this bounds its quadratic time and mask memory."""

    # ---- run ---------------------------------------------------------------------------------------------------
    seed: int = 42
    """Global seed (torch, numpy, python, data order, mini-batch shuffling)."""
    device: str = "auto"
    """Training device: ``auto`` picks CUDA when available, else CPU; or an explicit torch device string."""
    output_dir: str = "outputs/run"
    """Where metrics, reports and checkpoints go."""
    overwrite_output_dir: bool = False
    """Start afresh in an ``output_dir`` that already holds a run: everything a run writes there goes first
    (checkpoints, ``metrics.jsonl``, ``config.yaml``, TensorBoard events, curves and reports, the W&B run id; other
    files stay). Without it such a folder is refused unless ``--resume`` is given."""

    # ---- checkpoints, logs, evaluation, reports ----------------------------------------------------------------
    save_steps: int = Field(default=100, ge=1)
    """Checkpoint every this many steps (and at the end, and on Ctrl-C)."""
    keep_last: Optional[int] = Field(default=3, ge=1)
    """Checkpoints kept on disk (oldest removed first); None keeps all."""
    resume_strict: bool = False
    """``--resume`` when the latest checkpoint is damaged (a file missing, truncated or changed since the save,
    checked against the checkpoint's ``manifest.json``): false falls back to the newest intact checkpoint (with a
    warning naming the damaged file; the damaged one is set aside as ``step-N.damaged``), true refuses by name."""
    log_steps: int = Field(default=1, ge=1)
    """Write metrics (JSONL, TensorBoard, W&B) every this many steps; the progress bar shows every step."""
    tensorboard: bool = True
    """Write TensorBoard scalars under ``output_dir/tensorboard``."""
    wandb_project: Optional[str] = None
    """Log to this Weights & Biases project too (needs ``pip install wandb``); None disables W&B."""
    wandb_entity: Optional[str] = None
    """W&B entity (team or user); None uses the default."""
    wandb_run_name: Optional[str] = None
    """W&B run name; None lets W&B choose."""
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """W&B mode (``offline`` writes locally for a later ``wandb sync``)."""
    eval_steps: int = Field(default=0, ge=0)
    """Evaluate on held-out prompts every this many steps (and at the end); 0 disables evaluation. Evaluations sample
    from a seed of their own, so the cadence never changes what training samples."""
    eval_greedy: bool = True
    """Evaluate with greedy decoding (one response per prompt); False samples at the rollout temperature."""
    eval_samples_per_prompt: int = Field(default=1, ge=1)
    """Responses per evaluation prompt when ``eval_greedy`` is False."""
    report_steps: int = Field(default=50, ge=0)
    """Write the curves PNG and the HTML rollout report every this many steps (and at the end); 0: at the end only."""
    report_groups: int = Field(default=8, ge=1)
    """Prompt groups shown in the HTML rollout report."""
    progress_bar: bool = True
    """Show a progress bar with reward, KL, length, groups with reward variance and step time."""

    @field_validator("max_tokens_per_micro_batch")
    @classmethod
    def _check_budget(cls, value: Union[str, int, None]) -> Union[str, int, None]:
        return check_budget(value, "trainer.max_tokens_per_micro_batch")

    @model_validator(mode="after")
    def _check_batches(self) -> "TrainerConfig":
        if self.micro_train_batch_size > self.train_batch_size:
            raise ValueError(f"micro_train_batch_size ({self.micro_train_batch_size}) must not exceed "
                             f"train_batch_size ({self.train_batch_size})")
        return self
