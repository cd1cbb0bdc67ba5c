"""Rollout engines: one async client (`client.EngineClient`) for SGLang and for the embedded CPU engine.

- `protocol`: SGLang 0.5.23's paths and request fields (the one table both sides use).
- `client`: `EngineClient` (generate, pause/continue/abort, weight updates, LoRA, info) and
  `GenerateResult`; implements `sync.engine_api.EngineEndpoint`.
- `lora_tensors`: SGLang's `/load_lora_adapter_from_tensors` payload (by-value flattened bucket,
  sha256 checksums): encoded for the client, decoded for the embedded engine.
- `pool`: `EnginePool`, group-sticky, otherwise least-loaded routing over clients.
- `process`: start an engine server process, wait for health, stop it (`launch_embedded`).
- `sglang_launcher`: the `sglang.launch_server` command line RL needs (GPU machines).
- `sglang_options`: SGLang's server options (`engines.sglang`): the table, its checks, their argv.
- `embedded`: the CPU engine (`moe-rl serve MODEL_DIR`): transformers MoE, continuous batching.

Logprobs: both engines report, per sampled token, the model's log-softmax at temperature 1 on the
full sequence (SGLang's default `output_token_logprobs`; the embedded engine does the same).
"""
