"""The ``judge`` reward source: a vision-language model asked, through a rubric, whether an answer is right.

Rooms: ``rubric`` (render the judge's chat message from a Jinja template), ``verdict`` (turn the judge's output
into a score: a parsed verdict word or number, or the probability of a verdict token), ``backends`` (where the
judge runs: an OpenAI-compatible endpoint, or an in-process vLLM engine), ``ray_actor`` (that engine in a named
Ray actor of its own, shared by the run's processes), ``source`` (the reward source the engine calls: cache,
concurrency, failure entries, metrics). docs/rewards.md describes the configuration.
"""
