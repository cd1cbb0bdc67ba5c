"""The embedded CPU engine: SGLang's HTTP API around a transformers MoE model.

`runner` (model, KV-cached forward, routing capture, weight swap), `request` (sampling state and
the SGLang-shaped response), `scheduler` (continuous batching thread, pause modes), `lora` (PEFT
adapters: formats, binding to the model), `lora_hooks` (adapters applied per batch row, fused experts
included), `lora_routes` (SGLang's LoRA routes and registry rules), `server` (aiohttp routes,
validation, weight updates).
"""
