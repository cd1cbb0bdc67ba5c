"""`Sample`: the rollout contract round-trips exactly and rejects inconsistent lengths."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from moe_rl.sample import Sample, decode_routed_experts, encode_routed_experts


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
