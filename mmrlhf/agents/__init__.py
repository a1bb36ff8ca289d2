"""Multi-turn, tool-using rollouts with image observations ("thinking with images").

Layers inside the package (each imports only the ones above it in this list):

- :mod:`~mmrlhf.agents.types`: plain data (tool results, calls, trajectories);
- :mod:`~mmrlhf.agents.tool_base` (the Tool interface), :mod:`~mmrlhf.agents.boxes`,
  :mod:`~mmrlhf.agents.calculator`, :mod:`~mmrlhf.agents.builtin_tools`, :mod:`~mmrlhf.agents.tools` (the
  registry), :mod:`~mmrlhf.agents.calls`, :mod:`~mmrlhf.agents.environment` (with
  :mod:`~mmrlhf.agents.example_env`), :mod:`~mmrlhf.agents.runner`: the plug-ins (tools and environments), parsing
  the policy's calls, running them concurrently under deadlines;
- :mod:`~mmrlhf.agents.template`: observation tokens in the chat template's tool-turn form;
- :mod:`~mmrlhf.agents.rollout`: the turn loop over a rollout engine (token in, token out).

The experience maker calls the turn loop in place of one generation when ``agent`` is configured; everything after
generation (rewards, forwards, advantages, the update) is the single-turn code, with observation tokens masked.
"""
