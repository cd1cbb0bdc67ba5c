"""`Sample`: the rollout contract round-trips exactly and rejects inconsistent lengths."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from moe_rl.sample import Sample, decode_routed_experts, encode_routed_experts, routing_dtype


def make_sample(**overrides) -> Sample:
    rng = np.random.default_rng(0)
    fields = dict(
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5],
        rollout_logprobs=[-0.1234567890123, -2.5e-9],
        loss_mask=[1, 0],
        weight_versions=[3, 4],
        routed_experts=rng.integers(0, 64, size=(4, 3, 2)).astype(np.int32),
        reward=0.75,
        status="truncated",
        group_id="g7",
        segments=2,
        request_ids=["r1", "r2"],
        restarts=1,
        metadata={"task": "gsm8k", "n": [1, 2]},
    )
    return Sample(**{**fields, **overrides})


def test_round_trip_through_json_is_exact():
    sample = make_sample()
    again = Sample.from_dict(json.loads(json.dumps(sample.to_dict())))
    assert again == sample
    assert again.rollout_logprobs == sample.rollout_logprobs
    assert np.array_equal(again.routed_experts, sample.routed_experts) and again.routed_experts.dtype == np.int32
    assert Sample.from_dict(make_sample(routed_experts=None).to_dict()) == make_sample(routed_experts=None)


def test_a_rollout_record_with_string_versions_loads_as_integers():
    """rollout.json files written before versions were integers hold SGLang's labels ("3")."""
    old = {**make_sample().to_dict(), "weight_versions": ["3", "4"]}
    assert Sample.from_dict(json.loads(json.dumps(old))) == make_sample()


def test_a_rollout_record_with_segments_in_its_metadata_loads_them_as_fields():
    """rollout.json files and run checkpoints written before segments were fields kept them in the
    metadata (num_segments, rids, restarts)."""
    old = make_sample().to_dict()
    old["metadata"] = {**old["metadata"], "num_segments": 2, "rids": ["r1", "r2"], "restarts": 1}
    for field in ("segments", "request_ids", "restarts"):
        del old[field]
    assert Sample.from_dict(json.loads(json.dumps(old))) == make_sample()
    with pytest.raises(ValueError, match="Sample.segments=-1"):
        make_sample(segments=-1)


def test_routed_experts_use_sglang_encoding():
    routed = np.arange(24, dtype=np.int32).reshape(4, 3, 2)
    encoded = encode_routed_experts(routed)
    # SGLang: base64 of the little-endian int32 buffer, C order (extract_routed_experts_from_meta_info)
    assert np.array_equal(np.frombuffer(base64.b64decode(encoded), dtype="<i4"), routed.ravel())
    assert np.array_equal(decode_routed_experts(encoded, 3, 2), routed)
    with pytest.raises(ValueError, match="num_layers"):
        decode_routed_experts(encoded, 5, 2)


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"rollout_logprobs": [-1.0]}, "rollout_logprobs"),
        ({"loss_mask": [1, 1, 1]}, "loss_mask"),
        ({"weight_versions": []}, "weight_versions"),
        ({"weight_versions": ["3", "4"]}, "weight_versions"),
        ({"weight_versions": [3, -1]}, "weight_versions"),
        ({"routed_experts": np.zeros((5, 3, 2), np.int32)}, "routed_experts"),
        ({"routed_experts": np.zeros((4, 3, 2), np.int64)}, "routed_experts"),
        ({"status": "done"}, "status"),
    ],
)
def test_inconsistent_samples_are_rejected(overrides, field):
    with pytest.raises(ValueError, match=field):
        make_sample(**overrides)


@pytest.mark.parametrize("num_experts, dtype", [(None, np.int32), (4, np.uint8), (256, np.uint8), (257, np.int16)])
def test_routing_is_narrowed_at_the_decode(num_experts, dtype):
    """SGLang's int32 wire format decodes to `routing_dtype(num_experts)`, values unchanged."""
    experts = num_experts or 64
    routed = np.random.default_rng(1).integers(0, experts, size=(4, 3, 2)).astype(np.int32)
    routed[0, 0] = [0, experts - 1]
    assert routing_dtype(num_experts) == dtype
    decoded = decode_routed_experts(encode_routed_experts(routed), 3, 2, num_experts)
    assert decoded.dtype == dtype and np.array_equal(decoded, routed)


def test_routing_dtype_limits():
    assert routing_dtype(32768) == np.int16
    with pytest.raises(ValueError, match="int16"):
        routing_dtype(32769)
    with pytest.raises(ValueError, match="num_experts"):  # an id that would not survive the narrowing
        decode_routed_experts(encode_routed_experts(np.full((1, 1, 2), 300, np.int32)), 1, 2, 256)


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32])
def test_round_trip_keeps_the_routing_dtype(dtype):
    sample = make_sample(routed_experts=make_sample().routed_experts.astype(dtype))
    data = json.loads(json.dumps(sample.to_dict()))
    assert data["routed_experts_dtype"] == np.dtype(dtype).name
    again = Sample.from_dict(data)
    assert again == sample and again.routed_experts.dtype == dtype
    assert np.array_equal(again.routed_experts, sample.routed_experts)
    if dtype is not np.int32:  # equality includes the dtype
        assert again != make_sample(routed_experts=sample.routed_experts.astype(np.int32))


def test_a_dict_written_before_narrowing_loads_as_int32():
    """Older records hold SGLang's int32 encoding and no dtype field."""
    sample = make_sample()
    old = {**sample.to_dict(), "routed_experts": encode_routed_experts(sample.routed_experts)}
    del old["routed_experts_dtype"]
    again = Sample.from_dict(json.loads(json.dumps(old)))
    assert again.routed_experts.dtype == np.int32 and again == sample


def test_the_client_decodes_routing_narrow():
    """`EngineClient(num_experts=...)`: a response's routing arrives as uint8 in GenerateResult."""
    import asyncio

    from moe_rl.engine.client import EngineClient

    routed = np.arange(8, dtype=np.int32).reshape(2, 2, 2) % 4
    client = EngineClient("http://unused", num_hidden_layers=2, topk=2, num_experts=4)
    meta = {"weight_version": "0", "finish_reason": {"type": "stop"}, "routed_experts": encode_routed_experts(routed)}
    result = asyncio.run(client._result("r", {"output_ids": [5, 6], "meta_info": meta}))
    assert result.routed_experts.dtype == np.uint8 and np.array_equal(result.routed_experts, routed)
