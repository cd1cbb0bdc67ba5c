"""A run's plan before launch (`moe-rl plan`): where its processes go and whether they fit.

- `moe_rl.plan.planner`: `make_plan`: placement, parallel groups, memory per GPU, sync bytes;
- `moe_rl.plan.sync_links`: the weight sync modelled from the bytes each link carries;
- `moe_rl.plan.launch`: each engine's SGLang launch command, from the launcher's own code.
"""
