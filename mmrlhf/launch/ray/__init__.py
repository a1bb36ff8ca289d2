"""Ray launch mode: rollout actors (:class:`~mmrlhf.launch.ray.holder.ExperienceMakerHolder`) generate and score
experiences, a trainer actor (:mod:`mmrlhf.launch.ray.trainer_actor`) updates the policy and pushes the new
weights back, the driver (:func:`mmrlhf.launch.ray.driver.run_ray`) schedules both under a staleness bound
(:mod:`mmrlhf.launch.ray.ledger`). Importing this package does not import ray; the modules that need it do."""
