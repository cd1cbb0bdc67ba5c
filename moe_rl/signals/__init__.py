"""Learning signals from outside moe-rl's own tasks: environment hubs (verifiers, OpenEnv,
reasoning-gym), a served teacher for on-policy distillation, and served judges.

Each adapter is one module here and stays thin: it turns the outside package's prompts into
`moe_rl.tasks.Prompt`s and its scorer into a reward, or scores the student's tokens with a model
reached through the same `EngineClient` the rollout engines use. docs/signals.md is the user's page.
"""
