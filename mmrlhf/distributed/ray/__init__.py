"""Ray launch mode: rollout actors (:class:`~mmrlhf.distributed.ray.holder.ExperienceMakerHolder`) generate and score
experiences, a trainer actor (:mod:`mmrlhf.distributed.ray.trainer_actor`) updates the policy and pushes the new
weights back, the driver (:func:`mmrlhf.distributed.ray.driver.run_ray`) schedules both under a staleness bound
(:mod:`mmrlhf.distributed.ray.ledger`). Importing this package does not import ray; the modules that need it do."""
