"""The GPU memory plan of a run (``mmrlhf config show CONFIG --plan``), from the model's config and the run's keys.

* :mod:`~mmrlhf.models.memory.counts`: exact parameter counts (meta-device model, the trainer's freeze / LoRA rules);
* :mod:`~mmrlhf.models.memory.activations`: one micro-batch's activation bytes (checked against autograd's);
* :mod:`~mmrlhf.models.memory.plan`: bytes per component, phase, GPU and launch mode, from plain inputs;
* :mod:`~mmrlhf.models.memory.inputs`: the one place that reads the config into those inputs;
* :mod:`~mmrlhf.models.memory.advice`: the verdict and the keys that make a plan fit; JSON;
* :mod:`~mmrlhf.models.memory.render`: the text tables.
"""
