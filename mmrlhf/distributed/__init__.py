"""Launch modes beyond one process: ``torchrun`` + FSDP2 (:mod:`mmrlhf.distributed.torchrun`) and Ray actors
(:mod:`mmrlhf.distributed.ray`). :func:`mmrlhf.distributed.launch.resolve_backend` picks the mode."""
