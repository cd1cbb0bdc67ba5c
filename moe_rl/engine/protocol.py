"""The engine HTTP API: SGLang 0.5.23's paths and request field names, in one table.

Copied from `sglang/srt/managers/io_struct.py` and `sglang/srt/entrypoints/http_server.py`
(0.5.23). The client only sends these names; the embedded engine accepts exactly these and answers
400 for anything else. Fields that SGLang accepts but the embedded engine cannot honour are in
`EMBEDDED_UNSUPPORTED` (400 with a message naming them when set to a non-default value).
"""

from __future__ import annotations

GENERATE_FIELDS = frozenset({
    "rid", "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "stream", "return_routed_experts",
    "routed_experts_start_len", "lora_path", "lora_id", "custom_logit_processor", "return_hidden_states",
    "log_metrics", "priority", "return_text_in_logprobs",
})
"""Subset of GenerateReqInput's fields that RL uses (the other fields are multimodal/disaggregation)."""

SAMPLING_FIELDS = frozenset({
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
    "regex", "ebnf", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "logit_bias", "sampling_seed", "custom_params",
})
"""SamplingParams' API fields."""

REQUEST_FIELDS: dict[str, frozenset[str]] = {
    "/generate": GENERATE_FIELDS,
    "/pause_generation": frozenset({"mode", "rid"}),
    "/continue_generation": frozenset({"torch_empty_cache", "rid"}),
    "/abort_request": frozenset({"rid", "abort_all", "finished_reason", "abort_message"}),
    "/flush_cache": frozenset({"timeout_s", "rid"}),
    "/update_weights_from_disk": frozenset({
        "model_path", "load_format", "abort_all_requests", "weight_version", "is_async",
        "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "manifest", "rid",
    }),
    "/init_weights_update_group": frozenset({
        "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "rid",
    }),
    "/update_weights_from_distributed": frozenset({
        "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
        "load_format", "selector", "torch_empty_cache", "rid",
    }),
    "/update_weights_from_tensor": frozenset({
        "serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version",
        "selector", "torch_empty_cache", "rid",
    }),
    "/destroy_weights_update_group": frozenset({"group_name", "rid"}),
    "/update_weight_version": frozenset({"new_version", "abort_all_requests", "rid"}),
    "/load_lora_adapter": frozenset({"lora_name", "lora_path", "pinned", "lora_id", "rid"}),
    "/unload_lora_adapter": frozenset({"lora_name", "lora_id", "rid"}),
    "/release_memory_occupation": frozenset({"tags", "rid"}),
    "/resume_memory_occupation": frozenset({"tags", "rid"}),
}

REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "/generate": ("input_ids",),
    "/update_weights_from_disk": ("model_path",),
    "/init_weights_update_group": ("master_address", "master_port", "rank_offset", "world_size"),
    "/update_weights_from_distributed": ("names", "dtypes", "shapes"),
    "/update_weights_from_tensor": ("serialized_named_tensors",),
    "/load_lora_adapter": ("lora_name", "lora_path"),
    "/unload_lora_adapter": ("lora_name",),
    "/update_weight_version": ("new_version",),
}

EMBEDDED_EXTENSIONS: dict[str, frozenset[str]] = {
    "/update_weights_from_distributed": frozenset({"checksum"}),
}
"""Fields only the embedded engine takes (sync.engine_api: the bucket's CRC-32, verified on receipt).
The client sends them to embedded engines only."""

PAUSE_MODES = ("abort", "retract", "in_place")

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""`/release_memory_occupation` / `/resume_memory_occupation` tags (SGLang's GPU memory types;
no tags = all of them). SGLang frees them only when launched with `--enable-memory-saver`."""

EMBEDDED_UNSUPPORTED = {
    # field -> value the embedded engine honours (anything else is refused with 400)
    "text": None, "stream": False, "logprob_start_len": None, "top_logprobs_num": None,
    "token_ids_logprob": None, "custom_logit_processor": None, "return_hidden_states": False,
    "stop": None, "stop_regex": None, "json_schema": None, "regex": None, "ebnf": None, "n": 1,
    "logit_bias": None, "custom_params": None, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0,
}


def unknown_fields(path: str, body: dict) -> list[str]:
    """Names in `body` that the embedded engine does not take for `path` (sampling params included)."""
    bad = sorted(set(body) - REQUEST_FIELDS[path] - EMBEDDED_EXTENSIONS.get(path, frozenset()))
    if path == "/generate" and isinstance(body.get("sampling_params"), dict):
        bad += sorted(f"sampling_params.{k}" for k in set(body["sampling_params"]) - SAMPLING_FIELDS)
    return bad
