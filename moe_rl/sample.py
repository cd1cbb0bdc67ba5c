"""`Sample`: one rollout (prompt + response) with everything the trainer needs from the engine.

Owns the rollout-record contract (docs/architecture.md, section 2, "The rollout record"):
per-token rollout logprobs and weight versions (one per response
token), the loss mask, and the routed experts of every token but the last, int32
`[prompt_len + response_len - 1, num_hidden_layers, topk]` in SGLang's layout. SGLang sends routed
experts as base64 of little-endian int32 in C order; `encode_routed_experts` /
`decode_routed_experts` are that wire format, used by both engines and by the client.
`to_dict` / `from_dict` give a JSON-safe form that round-trips exactly (floats included).

A multi-turn episode (`moe_rl.agents.episode`) is one Sample whose response alternates model
tokens (loss mask 1, logprob, version) and environment tokens (tool results, user turns, chat
template glue: loss mask 0, logprob 0.0, version None); routed experts cover every position.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any, Literal

import numpy as np

Status = Literal["completed", "truncated", "aborted"]
STATUSES = ("completed", "truncated", "aborted")


def encode_routed_experts(routed: np.ndarray) -> str:
    """int array [tokens - 1, layers, topk] -> SGLang's base64 of little-endian int32 (C order)."""
    return base64.b64encode(np.ascontiguousarray(routed, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(data: str, num_layers: int, topk: int) -> np.ndarray:
    """SGLang's base64 string -> int32 array [tokens - 1, num_layers, topk]."""
    flat = np.frombuffer(base64.b64decode(data), dtype="<i4")
    row = num_layers * topk
    if flat.size % row:
        raise ValueError(
            f"routed_experts has {flat.size} int32 values, not a multiple of num_layers*topk={row}: "
            "pass the model's num_hidden_layers and num_experts_per_tok"
        )
    return flat.astype(np.int32).reshape(-1, num_layers, topk)


@dataclasses.dataclass(kw_only=True)
class Sample:
    """One prompt + response. Lists are per token; `routed_experts` may be None (not requested)."""

    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    rollout_logprobs: list[float] = dataclasses.field(default_factory=list)
    """Engine logprob of each response token (raw model log-softmax, see moe_rl.engine)."""
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    """1 where the token is trained on; one entry per response token."""
    weight_versions: list[int | None] = dataclasses.field(default_factory=list)
    """Weight version that produced each response token (an integer; engines label versions with
    SGLang's strings, which the client parses); None on an environment token (not sampled)."""
    routed_experts: np.ndarray | None = None
    """int32 [prompt_len + response_len - 1, num_hidden_layers, topk]."""
    reward: float | None = None
    status: Status = "completed"
    group_id: str = ""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field whose length or value breaks the contract."""
        n = len(self.response_ids)
        for name in ("rollout_logprobs", "loss_mask", "weight_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Sample.{name} has {len(getattr(self, name))} entries but response_ids has {n}: "
                    "give one entry per response token"
                )
        bad = [v for v in self.weight_versions if v is not None and (type(v) is not int or v < 0)]
        if bad:
            raise ValueError(
                f"Sample.weight_versions holds {bad[0]!r}: versions are non-negative integers (parse an "
                "engine's string label with int()), or None on an environment token"
            )
        if self.status not in STATUSES:
            raise ValueError(f"Sample.status={self.status!r}: use one of {STATUSES}")
        if self.routed_experts is not None:
            routed = self.routed_experts
            expected = len(self.prompt_ids) + n - 1
            if routed.dtype != np.int32 or routed.ndim != 3 or routed.shape[0] != expected:
                raise ValueError(
                    f"Sample.routed_experts is {routed.dtype} {tuple(routed.shape)}; expected int32 "
                    f"[{expected} (prompt_len + response_len - 1), num_hidden_layers, topk]"
                )

    def model_versions(self) -> list[int]:
        """The versions of the sampled tokens (environment tokens have none)."""
        return [v for v in self.weight_versions if v is not None]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict; routed experts in SGLang's base64 form plus their shape."""
        out = dataclasses.asdict(self)
        if self.routed_experts is not None:
            out["routed_experts"] = encode_routed_experts(self.routed_experts)
            out["routed_experts_shape"] = list(self.routed_experts.shape)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        data = dict(data)
        shape = data.pop("routed_experts_shape", None)
        if data.get("routed_experts") is not None:
            if shape is None:
                raise ValueError("Sample dict has routed_experts but no routed_experts_shape")
            data["routed_experts"] = decode_routed_experts(data["routed_experts"], shape[1], shape[2])
        # rollout.json files written before versions were integers hold them as strings ("3")
        data["weight_versions"] = [None if v is None else int(v) for v in data.get("weight_versions", [])]
        return cls(**data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        mine, theirs = dataclasses.asdict(self), dataclasses.asdict(other)
        a, b = mine.pop("routed_experts"), theirs.pop("routed_experts")
        same_routing = (a is None and b is None) or (
            a is not None and b is not None and a.shape == b.shape and np.array_equal(a, b)
        )
        return mine == theirs and same_routing
