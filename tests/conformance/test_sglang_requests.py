"""The engine HTTP API against SGLang 0.5.23's own request classes (conformance tier).

`moe_rl.engine.protocol`'s tables equal the fields of SGLang's io_struct / SamplingParams /
LoadSnapshot classes, its unsupported-field defaults are SGLang's defaults, and the embedded engine
serves a /generate body built by SGLang's GenerateReqInput with every field at its default (plus
what sglang-router adds) exactly like the minimal body.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.request

import pytest

from moe_rl.engine import protocol
from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from tests.conformance import sglang_oracle
from tests.engine.engine_helpers import save_tiny_model
from tests.engine.test_engine_requests import post

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

REQUEST_CLASSES = {
    "/generate": "GenerateReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/abort_request": "AbortReq",
    "/flush_cache": "FlushCacheReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/load_lora_adapter_from_tensors": "LoadLoRAAdapterFromTensorsReqInput",
    "/classify": "EmbeddingReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
}
"""The io_struct class each SGLang handler parses its body into (http_server.py)."""

ROUTER_ADDITIONS = {
    "model": "default",
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}


# -- run in the oracle process ----------------------------------------------------------------------


def _sampling_internal(cls) -> set[str]:
    """SamplingParams' fields declared under its "Internal fields" comment."""
    import inspect
    import re

    return set(re.findall(r"^    (\w+):", inspect.getsource(cls).split("# --- Internal fields")[1], re.M))


def _sglang_tables() -> dict:
    import msgspec
    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.managers import io_struct
    from sglang.srt.managers.load_snapshot import _CORE_KEYS
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    def struct(cls) -> dict:
        if dataclasses.is_dataclass(cls):  # EmbeddingReqInput
            fields = dataclasses.fields(cls)
            required = [f.name for f in fields if dataclasses.MISSING is f.default is f.default_factory]
            return {"fields": [f.name for f in fields], "required": required}
        fields = msgspec.structs.fields(cls)
        return {"fields": [f.name for f in fields], "required": [f.name for f in fields if f.required]}

    internal = _sampling_internal(SamplingParams)
    generate = {f.name: f.default for f in dataclasses.fields(io_struct.GenerateReqInput)}
    return {
        "classes": {
            path: struct(getattr(io_struct, name)) for path, name in REQUEST_CLASSES.items() if path != "/generate"
        },
        "generate": {"fields": list(generate), "defaults": {k: repr(v) for k, v in generate.items()}},
        "sampling": {
            "fields": list(SamplingParams.__struct_fields__),
            "internal": sorted(internal),
            "defaults": {k: repr(getattr(SamplingParams(), k)) for k in SamplingParams.__struct_fields__},
        },
        "load_keys": list(_CORE_KEYS),
        "server_args": [f.name for f in record_fields(ServerArgs)],
    }


def _default_generate_body(input_ids: list[int], sampling: dict) -> dict:
    """GenerateReqInput(...) as the JSON body a client sends: every field present, at its default
    (sampling_params too: every SamplingParams API field at its default but `sampling`)."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    api = [f for f in SamplingParams.__struct_fields__ if f not in _sampling_internal(SamplingParams)]
    defaults = SamplingParams()
    params = {f: getattr(defaults, f) for f in api} | sampling
    request = GenerateReqInput(
        input_ids=input_ids, sampling_params=params, return_logprob=True, return_routed_experts=True
    )
    return json.loads(json.dumps(dataclasses.asdict(request)))


# -- the tables -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sglang():
    return sglang_oracle.call(_sglang_tables)


def test_request_tables_are_sglang_classes_fields(sglang):
    for path, cls in sglang["classes"].items():
        assert protocol.REQUEST_FIELDS[path] == set(cls["fields"]), path
        assert set(protocol.REQUIRED_FIELDS.get(path, ())) == set(cls["required"]), path
    assert set(protocol.REQUEST_FIELDS) == set(REQUEST_CLASSES)
    assert protocol.GENERATE_FIELDS == set(sglang["generate"]["fields"])
    assert not protocol.ROUTER_IGNORED & set(sglang["generate"]["fields"])
    assert set(ROUTER_ADDITIONS) - protocol.ROUTER_IGNORED <= protocol.GENERATE_FIELDS
    sampling = sglang["sampling"]
    assert protocol.SAMPLING_FIELDS == set(sampling["fields"]) - set(sampling["internal"])
    assert {"stop_strs", "is_normalized"} <= set(sampling["internal"])


def test_unsupported_fields_default_to_sglangs_defaults(sglang):
    generate, sampling = sglang["generate"]["defaults"], sglang["sampling"]["defaults"]
    for field, default in protocol.EMBEDDED_UNSUPPORTED.items():
        sglang_defaults = {d[field] for d in (generate, sampling) if field in d}
        assert sglang_defaults == {repr(default)}, field
    assert set(protocol.DEFAULT_EQUIVALENTS) <= set(protocol.EMBEDDED_UNSUPPORTED)


def test_load_and_server_info_use_sglang_names(sglang, engine):
    assert list(protocol.LOAD_FIELDS) == sglang["load_keys"]
    info = get(engine.url + "/server_info")
    assert set(info) - {"version"} <= set(sglang["server_args"]), set(info) - set(sglang["server_args"])


# -- the embedded engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with launch_embedded(
        EmbeddedConfig(model_path=save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe")), threads=1)
    ) as engine:
        yield engine


def get(url: str):
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def test_a_body_with_every_sglang_default_is_served_like_the_minimal_one(engine):
    ids, sampling = [3, 1, 4, 1, 5], {"max_new_tokens": 4, "temperature": 0.0}
    body = sglang_oracle.call(_default_generate_body, ids, sampling) | ROUTER_ADDITIONS
    assert set(body) - protocol.ROUTER_IGNORED == protocol.GENERATE_FIELDS  # every field is there
    assert set(body["sampling_params"]) == protocol.SAMPLING_FIELDS
    status, text = post(engine.url + "/generate", body)
    assert status == 200, text
    minimal = {"input_ids": ids, "sampling_params": sampling, "return_logprob": True, "return_routed_experts": True}
    status, reference = post(engine.url + "/generate", minimal)
    assert status == 200, reference
    served, reference = json.loads(text), json.loads(reference)
    assert served["output_ids"] == reference["output_ids"] and len(served["output_ids"]) == 4
    for key in ("output_token_logprobs", "routed_experts", "finish_reason"):
        assert served["meta_info"][key] == reference["meta_info"][key], key


@pytest.mark.parametrize(
    "extra",
    [
        {"logprob_start_len": -1},
        {"logprob_start_len": 0, "return_logprob": True},
        {"top_logprobs_num": 0},
        {"routed_dp_rank": 0},
        {"stream": False},
        {"sampling_params": {"max_new_tokens": 2, "temperature": None, "top_k": 1 << 30, "stop": None}},
    ],
)
def test_sglang_defaults_and_their_equivalents_are_served(engine, extra):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}} | extra
    status, text = post(engine.url + "/generate", body)
    assert status == 200, text


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"top_logprobs_num": 2}, "top_logprobs_num"),
        ({"return_entropy": True}, "return_entropy"),
        ({"background": True}, "background"),
        ({"routed_dp_rank": 1}, "routed_dp_rank"),
        ({"sampling_params": {"beam_width": 2}}, "sampling_params.beam_width"),
        ({"sampling_params": {"stop_strs": ["x"]}}, "sampling_params.stop_strs"),  # internal: unknown
        ({"http_worker_ipc": "ipc:///tmp/x"}, "http_worker_ipc"),
    ],
)
def test_unsupported_values_are_refused_naming_the_field(engine, extra, field):
    status, text = post(engine.url + "/generate", {"input_ids": [1, 2, 3]} | extra)
    assert status == 400 and field in text, text


def test_server_info_and_load(engine):
    for path in ("/server_info", "/get_server_info"):
        info = get(engine.url + path)
        assert info["tp_size"] == info["dp_size"] == info["pp_size"] == 1 and info["version"] == "embedded"
        assert info["weight_version"] == "0" and info["model_path"]
    (load,) = get(engine.url + "/get_load")
    assert list(load) == list(protocol.LOAD_FIELDS) and load["dp_rank"] == 0 and load["num_running_reqs"] == 0
    loads = get(engine.url + "/v1/loads")
    assert set(loads) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    assert list(loads["loads"][0]) == list(protocol.LOAD_FIELDS)
