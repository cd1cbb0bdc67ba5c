"""The engine HTTP API: SGLang 0.5.23's paths and request field names, in one table.

Copied from `sglang/srt/managers/io_struct.py`, `sglang/srt/sampling/sampling_params.py` and
`sglang/srt/entrypoints/http_server.py` (0.5.23); `tests/conformance/test_sglang_requests.py`
checks every table against SGLang's own classes. The client only sends these names; the embedded
engine accepts exactly these (plus `ROUTER_IGNORED`) and answers 400 for anything else. Fields
that SGLang accepts but the embedded engine cannot honour are in `EMBEDDED_UNSUPPORTED` with
SGLang's default: a body with the field at that default is served, any other value is refused
(400 naming the field).
"""

from __future__ import annotations

GENERATE_FIELDS = frozenset(
    {
        "rid",
        "session_id",
        "text",
        "input_ids",
        "input_embeds",
        "image_data",
        "video_data",
        "audio_data",
        "mm_hashes",
        "mm_content_hashes",
        "use_audio_in_video",
        "video_config",
        "sampling_params",
        "watermark",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "token_ids_logprob",
        "return_sampling_mask",
        "sampling_logprobs_mode",
        "return_text_in_logprobs",
        "return_flat_raw_top_logprobs",
        "return_flat_raw_output_top_logprobs",
        "return_flat_raw_top_logprobs_b64",
        "stream",
        "log_metrics",
        "return_hidden_states",
        "return_routed_experts",
        "routed_experts_start_len",
        "return_indexer_topk",
        "modalities",
        "session_params",
        "lora_path",
        "lora_id",
        "custom_logit_processor",
        "positional_embed_overrides",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "decode_tp_size",
        "routed_dp_rank",
        "data_parallel_rank",
        "disagg_prefill_dp_rank",
        "routing_key",
        "conversation_id",
        "background",
        "require_reasoning",
        "max_thinking_tokens",
        "priority",
        "extra_key",
        "no_logs",
        "custom_labels",
        "return_bytes",
        "return_entropy",
        "return_prompt_token_ids",
        "external_trace_header",
        "received_time",
        "need_wait_for_mm_inputs",
        "num_items_assigned",
        "encoder_urls",
        "max_dynamic_patch",
        "min_dynamic_patch",
        "image_max_dynamic_patch",
        "video_max_dynamic_patch",
        "images_config",
        "mm_processor_kwargs",
        "multi_item_delimiter_indices",
        "token_indices_to_pool",
        "cache_salt",
        "kv_hints",
        "http_worker_ipc",
    }
)
"""GenerateReqInput's fields."""

SAMPLING_FIELDS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "beam_width",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
        "watermark",
    }
)
"""SamplingParams' API fields: its constructor arguments but the ones under "Internal fields" in
sampling_params.py (`stop_strs`, `stop_str_max_len`, `is_normalized`, ...), which `__post_init__`
and `normalize()` overwrite from the API fields (`is_normalized=True` would skip that)."""

ROUTER_IGNORED = frozenset({"model"})
"""A key sglang-router adds to every /generate body that is no GenerateReqInput field: SGLang
ignores unknown keys (FastAPI's dataclass parse and its `GenerateRequest` contract both drop them),
so the embedded engine ignores it too. The router's other additions (`background`, `no_logs`,
`return_bytes`, `return_entropy`) are GenerateReqInput fields, sent at their defaults."""

REQUEST_FIELDS: dict[str, frozenset[str]] = {
    # path -> the fields of the io_struct class its SGLang handler parses the body into. Every class has
    # `http_worker_ipc` (BaseReq; GenerateReqInput declares it): the tokenizer worker that owns the
    # request, stamped by the tokenizer manager in multi-tokenizer mode. SGLang's HTTP layer builds the
    # class from the body, so a client can send it and it is listed; only None means anything to the
    # embedded engine (one HTTP worker), and /generate refuses any other value (EMBEDDED_UNSUPPORTED).
    "/generate": GENERATE_FIELDS,  # GenerateReqInput
    "/pause_generation": frozenset({"mode", "rid", "http_worker_ipc"}),  # PauseGenerationReqInput
    "/continue_generation": frozenset({"torch_empty_cache", "rid", "http_worker_ipc"}),  # ContinueGenerationReqInput
    "/abort_request": frozenset(
        {  # AbortReq (SGLang's handler reads only rid and abort_all)
            "rid",
            "abort_all",
            "finished_reason",
            "abort_message",
            "weight_versions",
            "http_worker_ipc",
        }
    ),
    "/flush_cache": frozenset({"timeout_s", "rid", "http_worker_ipc"}),  # FlushCacheReqInput
    "/update_weights_from_disk": frozenset(
        {  # UpdateWeightFromDiskReqInput
            "model_path",
            "load_format",
            "abort_all_requests",
            "weight_version",
            "is_async",
            "torch_empty_cache",
            "keep_pause",
            "recapture_cuda_graph",
            "token_step",
            "flush_cache",
            "manifest",
            "rid",
            "http_worker_ipc",
        }
    ),
    "/init_weights_update_group": frozenset(
        {  # InitWeightsUpdateGroupReqInput
            "master_address",
            "master_port",
            "rank_offset",
            "world_size",
            "group_name",
            "backend",
            "rid",
            "http_worker_ipc",
        }
    ),
    "/update_weights_from_distributed": frozenset(
        {  # UpdateWeightsFromDistributedReqInput
            "names",
            "dtypes",
            "shapes",
            "group_name",
            "flush_cache",
            "abort_all_requests",
            "weight_version",
            "load_format",
            "selector",
            "torch_empty_cache",
            "rid",
            "http_worker_ipc",
        }
    ),
    "/update_weights_from_tensor": frozenset(
        {  # UpdateWeightsFromTensorReqInput
            "serialized_named_tensors",
            "load_format",
            "flush_cache",
            "abort_all_requests",
            "weight_version",
            "selector",
            "torch_empty_cache",
            "rid",
            "http_worker_ipc",
        }
    ),
    "/begin_weight_update": frozenset({"selector", "rid", "http_worker_ipc"}),  # BeginWeightUpdateReqInput
    "/end_weight_update": frozenset({"rid", "http_worker_ipc"}),  # EndWeightUpdateReqInput
    "/destroy_weights_update_group": frozenset({"group_name", "rid", "http_worker_ipc"}),
    "/update_weight_version": frozenset({"new_version", "abort_all_requests", "rid", "http_worker_ipc"}),
    "/load_lora_adapter": frozenset({"lora_name", "lora_path", "pinned", "lora_id", "rid", "http_worker_ipc"}),
    "/load_lora_adapter_from_tensors": frozenset(
        {  # LoadLoRAAdapterFromTensorsReqInput
            "lora_name",
            "config_dict",
            "serialized_named_tensors",
            "pinned",
            "added_tokens_config",
            "lora_id",
            "load_format",
            "expected_checksums",
            "rid",
            "http_worker_ipc",
        }
    ),
    "/unload_lora_adapter": frozenset({"lora_name", "lora_id", "rid", "http_worker_ipc"}),
    "/classify": frozenset(
        {  # EmbeddingReqInput (a reward model's head, SGLang --is-embedding)
            "rid",
            "text",
            "input_ids",
            "input_embeds",
            "image_data",
            "video_data",
            "audio_data",
            "embed_override_token_id",
            "embed_overrides",
            "sampling_params",
            "log_metrics",
            "modalities",
            "is_cross_encoder_request",
            "lora_path",
            "lora_id",
            "positional_embed_overrides",
            "routing_key",
            "http_worker_ipc",
            "background",
            "priority",
            "dimensions",
            "return_pooled_hidden_states",
            "return_prompt_token_ids",
            "external_trace_header",
            "received_time",
            "multi_item_delimiter_indices",
            "token_indices_to_pool",
            "decision_layout",
        }
    ),
    "/release_memory_occupation": frozenset({"tags", "rid", "http_worker_ipc"}),
    "/resume_memory_occupation": frozenset({"tags", "rid", "http_worker_ipc"}),
}
"""The io_struct class behind each path: `tests/conformance/test_sglang_requests.py` REQUEST_CLASSES."""

REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "/generate": ("input_ids",),
    "/update_weights_from_disk": ("model_path",),
    "/init_weights_update_group": ("master_address", "master_port", "rank_offset", "world_size"),
    "/update_weights_from_distributed": ("names", "dtypes", "shapes"),
    "/update_weights_from_tensor": ("serialized_named_tensors",),
    "/load_lora_adapter": ("lora_name", "lora_path"),
    "/load_lora_adapter_from_tensors": ("lora_name", "config_dict", "serialized_named_tensors"),
    "/unload_lora_adapter": ("lora_name",),
    "/update_weight_version": ("new_version",),
}

EMBEDDED_EXTENSIONS: dict[str, frozenset[str]] = {
    "/update_weights_from_distributed": frozenset({"checksum"}),
}
"""Fields only the embedded engine takes (sync.engine_api: the bucket's CRC-32, verified on receipt).
The client sends them to embedded engines only."""

EMBEDDED_ROUTES: dict[str, frozenset[str]] = {
    "/feed_peers": frozenset({"engines", "bucket_bytes", "timeout_s", "backend"}),  # sync.peer_feed
}
"""Routes only the embedded engine has (SGLang 0.5.23 has no counterpart), with their fields."""

PAUSE_MODES = ("abort", "retract", "in_place")

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""`/release_memory_occupation` / `/resume_memory_occupation` tags (SGLang's GPU memory types;
no tags = all of them). SGLang frees them only when launched with `--enable-memory-saver`."""

EMBEDDED_UNSUPPORTED = {
    # field -> SGLang's default (GenerateReqInput's, or SamplingParams' for a sampling field; `watermark`
    # is both, default None in both); the embedded engine serves the field at this value only.
    # Generation: text (no tokenizer), multimodal and disaggregation inputs, streaming, top logprobs,
    # hidden states, sessions, reasoning, DP routing.
    "text": None,
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "mm_hashes": None,
    "mm_content_hashes": None,
    "use_audio_in_video": False,
    "video_config": None,
    "watermark": None,
    "top_logprobs_num": None,
    "token_ids_logprob": None,
    "return_sampling_mask": None,
    "sampling_logprobs_mode": None,
    "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False,
    "stream": False,
    "return_hidden_states": False,
    "return_indexer_topk": False,
    "modalities": None,
    "session_params": None,
    "custom_logit_processor": None,
    "positional_embed_overrides": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "bootstrap_pair_key": None,
    "decode_tp_size": None,
    "routed_dp_rank": None,
    "data_parallel_rank": None,
    "disagg_prefill_dp_rank": None,
    "background": False,
    "require_reasoning": False,
    "max_thinking_tokens": None,
    "return_bytes": False,
    "return_entropy": False,
    "return_prompt_token_ids": False,
    "need_wait_for_mm_inputs": None,
    "num_items_assigned": None,
    "encoder_urls": None,
    "max_dynamic_patch": None,
    "min_dynamic_patch": None,
    "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None,
    "images_config": None,
    "mm_processor_kwargs": None,
    "multi_item_delimiter_indices": None,
    "token_indices_to_pool": None,
    "http_worker_ipc": None,
    # Sampling: stop strings and grammars (no tokenizer), penalties, min_p, parallel and beam sampling.
    "stop": None,
    "stop_regex": None,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "beam_width": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
}
"""The other GenerateReqInput / SamplingParams fields are honoured (`input_ids`, `rid`, `return_logprob`,
`logprob_start_len` (prompt logprobs), `return_routed_experts`, `lora_path`, the sampler's) or have
nothing to act on in the embedded engine and are accepted with any value: labels and bookkeeping
(`session_id`, `routing_key`, `conversation_id`, `custom_labels`, `external_trace_header`,
`received_time`, `log_metrics`, `no_logs`, `priority`, `lora_id`), cache keys and hints (no prefix
cache: `extra_key`, `cache_salt`, `kv_hints`), `stream_interval` (no streaming) and
`return_text_in_logprobs` (no tokenizer: the text entries are None)."""

DEFAULT_EQUIVALENTS = {
    "top_logprobs_num": 0,
    "return_sampling_mask": False,
    "routed_dp_rank": 0,
    "data_parallel_rank": 0,
}
"""A second spelling of SGLang's default, also served: what SGLang's normalisation turns the None
default into (`top_logprobs_num=0`), or the only DP
rank of a dp_size 1 engine (SGLang 0.5.23 ignores `routed_dp_rank=0` there and refuses any other)."""


def weight_version_number(label: object) -> int | None:
    """The integer of a weight-version label: SGLang's decimal string ("3") or an int, not a bool;
    None for anything else (each side raises its own error)."""
    if isinstance(label, bool) or not (isinstance(label, int) or (isinstance(label, str) and label.isdigit())):
        return None
    version = int(label)
    return version if version >= 0 else None


BATCH_ITEM_FIELDS = ("rid", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "lora_path")
"""The /generate fields that SGLang's batch form (`GenerateReqInput.normalize_batch_and_arguments`)
takes per item when they are lists; every other field is the batch's as it is (one
`routed_experts_start_len`, one `return_routed_experts`)."""


def split_batch(body: dict) -> list[dict] | None:
    """A batch /generate body (`input_ids` a list of lists) as one body per item, as SGLang's
    normalisation splits it: a list in a `BATCH_ITEM_FIELDS` field gives each item its entry, a
    string `rid` gives item i `f"{rid}_{i}"`, anything else is every item's. None for a single
    request."""
    ids = body.get("input_ids")
    if not (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        return None
    n = len(ids)
    for field in BATCH_ITEM_FIELDS:
        value = body.get(field)
        if isinstance(value, list) and len(value) != n:
            raise ValueError(f"{field}: a list of {len(value)} for a batch of {n} input_ids; give one entry per item")
    items = []
    for i in range(n):
        item = {**body, "input_ids": ids[i]}
        for field in BATCH_ITEM_FIELDS:
            if isinstance(body.get(field), list):
                item[field] = body[field][i]
        if isinstance(body.get("rid"), str):
            item["rid"] = f"{body['rid']}_{i}"
        items.append(item)
    return items


def unknown_fields(path: str, body: dict) -> list[str]:
    """Names in `body` that the embedded engine does not take for `path` (sampling params included)."""
    extra = EMBEDDED_EXTENSIONS.get(path, frozenset()) | (ROUTER_IGNORED if path == "/generate" else frozenset())
    known = REQUEST_FIELDS[path] if path in REQUEST_FIELDS else EMBEDDED_ROUTES[path]
    bad = sorted(set(body) - known - extra)
    if path == "/generate":
        params = body.get("sampling_params")
        per_item = params if isinstance(params, list) else [params]  # a batch has one per item
        bad += sorted(
            {f"sampling_params.{k}" for p in per_item if isinstance(p, dict) for k in p.keys() - SAMPLING_FIELDS}
        )
    return bad


LOAD_FIELDS = (
    "timestamp",
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_uncached_tokens",
    "num_used_tokens",
    "num_total_tokens",
    "num_active_tokens",
    "num_prealloc_ready_tokens",
    "max_total_num_tokens",
    "max_running_requests",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
    "total_prefill_uncached_tokens",
    "total_prefill_busy_us",
    "decode_moments",
)
"""The core keys of SGLang's per-DP-rank load record (`LoadSnapshot.to_dict()`, managers/load_snapshot.py):
one record per rank in `GET /get_load`, under `loads` in `GET /v1/loads`."""
