"""Every request body the project's client sends to an SGLang engine, parsed and checked by SGLang
0.5.23's own request classes (conformance tier): the class SGLang's handler builds from the body
(io_struct, through the same pydantic schema as its FastAPI layer), no field the class lacks
(SGLang would drop it silently), `/generate` normalized as the tokenizer manager does and its
sampling params verified by SGLang's `SamplingParams`; a batch body's items as SGLang splits them
are the items `protocol.split_batch` gives the embedded engine."""

from __future__ import annotations

import pytest

from moe_rl.engine import protocol
from moe_rl.engine.client import EngineClient
from moe_rl.engine.sampling import SamplingParams
from tests.conformance import sglang_oracle
from tests.conformance.test_sglang_requests import REQUEST_CLASSES
from tests.engine.engine_helpers import run
from tests.engine.test_engine_requests import RecordingEngine

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

VOCAB = 64


def _client_bodies() -> list[tuple[str, dict]]:
    async def go():
        engine = RecordingEngine()
        client = EngineClient(await engine.start(), kind="sglang", backoff_s=0.01)
        await client.generate(
            [1, 2, 3],
            SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=5, stop_token_ids=[3], sampling_seed=1),
            return_routed_experts=True,
            routed_experts_start_len=2,
            lora_path="a",
        )
        await client.generate([1], SamplingParams(max_new_tokens=1))
        await client.generate_batch(
            [[1, 2, 3], [4]],
            [SamplingParams(max_new_tokens=4, sampling_seed=s) for s in (1, 2)],
            return_routed_experts=True,
            routed_experts_start_len=1,
            rids=["a", "b"],
        )
        for mode in ("abort", "retract", "in_place"):
            await client.pause_generation(mode)
        await client.continue_generation()
        await client.abort_request("r1")
        await client.abort_request()
        await client.update_weights_from_disk("/ckpt/v2", "2")
        await client.init_weights_update_group("10.0.0.1", 1234, 1, 5, "weight_update_group", "nccl")
        await client.begin_weight_update()
        await client.update_weights_from_distributed(
            ["w"], ["bfloat16"], [[2, 2]], "weight_update_group", None, "flattened_bucket", checksum="crc32:00000000#0"
        )
        await client.update_weights_from_tensor(["cGF5bG9hZA==", "cGF5bG9hZA=="], "flattened_bucket", None)
        await client.end_weight_update()
        await client.update_weight_version("2")
        await client.destroy_weights_update_group("weight_update_group")
        await client.load_lora_adapter("a", "/adapters/a")
        await client.release_memory_occupation(["weights", "kv_cache"])
        await client.resume_memory_occupation()
        await client.close()
        await engine.runner.cleanup()
        return engine.bodies

    return [(path, body) for path, body in run(go()) if path in REQUEST_CLASSES]


def _check_with_sglang(bodies: list[tuple[str, dict]], classes: dict[str, str], vocab: int) -> list[str]:
    """Oracle process: the problems SGLang's classes find in each body (empty: none)."""
    import pydantic
    from sglang.srt.managers import io_struct
    from sglang.srt.sampling.sampling_params import SamplingParams

    problems = []
    for path, body in bodies:
        cls = getattr(io_struct, classes[path])
        known = set(getattr(cls, "__struct_fields__", None) or cls.__dataclass_fields__)
        if unknown := set(body) - known:
            problems.append(f"{path}: {sorted(unknown)} are not fields of {cls.__name__}")
        try:
            request = pydantic.TypeAdapter(cls).validate_python(body)
            if path == "/generate":
                request.normalize_batch_and_arguments()
                if request.is_single:
                    SamplingParams(**request.sampling_params).verify(vocab)
                    continue
                for i, item in enumerate(protocol.split_batch(body)):  # SGLang's item i is ours
                    sub = request[i]
                    SamplingParams(**sub.sampling_params).verify(vocab)
                    for field in ("rid", "input_ids", "sampling_params", "return_logprob", "routed_experts_start_len"):
                        if getattr(sub, field) != item.get(field, getattr(sub, field)):
                            problems.append(
                                f"/generate batch item {i}: {field} {getattr(sub, field)!r} != {item[field]!r}"
                            )
        except Exception as error:  # noqa: BLE001 - reported per body
            problems.append(f"{path}: {type(error).__name__}: {error}")
    return problems


def test_every_body_the_client_sends_is_valid_for_sglang():
    bodies = _client_bodies()
    sent = {path for path, _ in bodies}
    assert sent >= {
        "/generate",
        "/pause_generation",
        "/update_weights_from_distributed",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_tensor",
        "/load_lora_adapter",
    }, sent
    assert sum(isinstance(body["input_ids"][0], list) for path, body in bodies if path == "/generate") == 1
    assert sglang_oracle.call(_check_with_sglang, bodies, REQUEST_CLASSES, VOCAB) == []
    distributed = next(body for path, body in bodies if path == "/update_weights_from_distributed")
    assert "checksum" not in distributed and "weight_version" not in distributed  # see sync.engine_api
