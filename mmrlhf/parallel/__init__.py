"""The ranks that train one run, as the trainer sees them (:class:`~mmrlhf.parallel.world.World`). Below the
trainer: the launch modes above (:mod:`mmrlhf.launch`) make the world; the loop only calls its collectives."""
