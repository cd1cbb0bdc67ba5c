"""Learning signals from outside moe-rl's own tasks (docs/signals.md is the user's page).

- environment hubs, each a thin adapter that turns the package's prompts into
  `moe_rl.tasks.Prompt`s and its scorer into the reward: `environment` (the `rollout.environment`
  section and the dispatch by kind), `verifiers_env`, `openenv_env`, `reasoning_gym_task`;
- served models reached through the same `EngineClient` the rollout engines use: `served` (a model
  started from `path` or reached at `url`), `teacher` (on-policy distillation: the teacher's
  logprobs of the student's tokens), `judge` (`rollout.reward: judge`);
- `config`: the judge's config section, apart from the code that runs it.
"""
