"""The benchmarks behind `moe-rl bench ...`: each measures its ratios side by side in one run.

- `moe_rl.bench.options`: every bench's typed options (`EngineBench`, `SyncBench`, `AsyncBench`,
  `TrainBench`);
- `moe_rl.bench.engine`: continuous batching against serial requests and `generate()`;
- `moe_rl.bench.sync`: a Megatron export's weight sync against a raw broadcast;
- `moe_rl.bench.lora`: adapter against full-weight sync on one engine;
- `moe_rl.bench.asynchrony`: sync against fully_async RL, drain against partial rollouts;
- `moe_rl.bench.train`: the trainer's padded against token-budget micro-batches.
"""
