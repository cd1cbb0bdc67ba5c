"""The embedded CPU engine: SGLang's HTTP API around a transformers MoE model.

`runner` (model, KV-cached forward, routing capture, weight swap), `request` (sampling state and
the SGLang-shaped response), `scheduler` (continuous batching thread, pause modes), `lora` (PEFT
adapters per request), `server` (aiohttp routes, validation, weight updates).
"""
