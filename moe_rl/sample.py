"""`Sample`: one rollout (prompt + response) with everything the trainer needs from the engine.

Owns the rollout-record contract (docs/architecture.md, section 2, "The rollout record"):
per-token rollout logprobs and weight versions (one per response
token), the loss mask, and the routed experts of every token but the last,
`[prompt_len + response_len - 1, num_hidden_layers, topk]` in SGLang's layout. SGLang sends routed
experts as base64 of little-endian int32 in C order; `encode_routed_experts` /
`decode_routed_experts` are that wire format, used by both engines and by the client. Past the
wire they are stored in the smallest dtype that holds an expert id (`routing_dtype`: uint8 up to
256 experts, int16 beyond), from the client's decode to the trainer's batch; int32 (the wire's,
and older `rollout.json` files') is accepted too. `to_dict` / `from_dict` give a JSON-safe form
that round-trips exactly (floats and the routing dtype included).

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


ROUTING_DTYPES = (np.dtype(np.uint8), np.dtype(np.int16), np.dtype(np.int32))
"""The dtypes a Sample's routed experts may have: `routing_dtype`'s two, and SGLang's int32."""


def routing_dtype(num_experts: int | None) -> np.dtype:
    """The dtype routed-expert ids are stored in for a model with `num_experts` routed experts:
    uint8 up to 256, int16 up to 32768 (a quarter / half of SGLang's int32 wire format); int32
    when the count is unknown (None)."""
    if num_experts is None:
        return np.dtype(np.int32)
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts}: a MoE model has at least one routed expert")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32768:
        return np.dtype(np.int16)
    raise ValueError(f"num_experts={num_experts}: routed-expert ids are stored as int16, which holds 32768 experts")


def encode_routed_experts(routed: np.ndarray) -> str:
    """int array [tokens - 1, layers, topk] -> SGLang's base64 of little-endian int32 (C order)."""
    return base64.b64encode(np.ascontiguousarray(routed, dtype="<i4").tobytes()).decode("ascii")


def decode_routed_experts(data: str, num_layers: int, topk: int, num_experts: int | None = None) -> np.ndarray:
    """SGLang's base64 string -> array [tokens - 1, num_layers, topk] of `routing_dtype(num_experts)`;
    an id outside [0, num_experts) raises (it would not survive the narrowing)."""
    flat = _unpack(data, np.dtype("<i4"), num_layers, topk)
    if num_experts is not None and flat.size and (flat.min() < 0 or flat.max() >= num_experts):
        bad = flat.min() if flat.min() < 0 else flat.max()
        raise ValueError(
            f"routed_experts holds expert id {bad}, outside [0, {num_experts}): pass the model's "
            "number of routed experts (num_experts) of the model the engine serves"
        )
    return flat.astype(routing_dtype(num_experts))


def _unpack(data: str, wire: np.dtype, num_layers: int, topk: int) -> np.ndarray:
    flat = np.frombuffer(base64.b64decode(data), dtype=wire)
    row = num_layers * topk
    if flat.size % row:
        raise ValueError(
            f"routed_experts has {flat.size} {wire.name} values, not a multiple of num_layers*topk={row}: "
            "pass the model's num_hidden_layers and num_experts_per_tok"
        )
    return flat.reshape(-1, num_layers, topk)


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
    """[prompt_len + response_len - 1, num_hidden_layers, topk], uint8 / int16 (`routing_dtype`) or int32."""
    reward: float | None = None
    teacher_logprobs: list[float] | None = None
    """On-policy distillation: the teacher's logprob of each response token (`moe_rl.signals.teacher`);
    None without a teacher."""
    status: Status = "completed"
    group_id: str = ""
    segments: int = 0
    """Engine requests behind the response (`moe_rl.rollout.partial.continue_sample` counts them):
    0 before the first answer, more than one when generation was cut (a weight swap) and continued,
    or turns of an episode."""
    request_ids: list[str] = dataclasses.field(default_factory=list)
    """The engine's request id of each segment, in order."""
    restarts: int = 0
    """Times generation started this sample (or an episode's turn) over, its cut tokens thrown away
    (`rollout.partial_rollout: false`)."""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What the task and the agent carry along (the prompt's fields, the answer, episode facts)."""

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
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise ValueError(
                f"Sample.teacher_logprobs has {len(self.teacher_logprobs)} entries but response_ids has {n}: "
                "give one entry per response token, or None"
            )
        bad = [v for v in self.weight_versions if v is not None and (type(v) is not int or v < 0)]
        if bad:
            raise ValueError(
                f"Sample.weight_versions holds {bad[0]!r}: versions are non-negative integers (parse an "
                "engine's string label with int()), or None on an environment token"
            )
        if self.status not in STATUSES:
            raise ValueError(f"Sample.status={self.status!r}: use one of {STATUSES}")
        for name in ("segments", "restarts"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 0:
                raise ValueError(f"Sample.{name}={getattr(self, name)!r}: a count, a non-negative integer")
        if self.routed_experts is not None:
            routed = self.routed_experts
            expected = len(self.prompt_ids) + n - 1
            if routed.dtype not in ROUTING_DTYPES or routed.ndim != 3 or routed.shape[0] != expected:
                raise ValueError(
                    f"Sample.routed_experts is {routed.dtype} {tuple(routed.shape)}; expected uint8, int16 "
                    f"or int32 [{expected} (prompt_len + response_len - 1), num_hidden_layers, topk] "
                    "(moe_rl.sample.routing_dtype)"
                )

    def model_versions(self) -> list[int]:
        """The versions of the sampled tokens (environment tokens have none)."""
        return [v for v in self.weight_versions if v is not None]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict; routed experts as base64 of their little-endian bytes in their own dtype
        (C order), plus shape and dtype."""
        out = dataclasses.asdict(self)
        routed = self.routed_experts
        if routed is not None:
            wire = routed.dtype.newbyteorder("<")
            out["routed_experts"] = base64.b64encode(np.ascontiguousarray(routed, dtype=wire).tobytes()).decode()
            out["routed_experts_shape"] = list(routed.shape)
            out["routed_experts_dtype"] = routed.dtype.name
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        """`to_dict`'s inverse; a dict without `routed_experts_dtype` (written before routing was
        narrowed) holds SGLang's int32 and loads as int32."""
        data = dict(data)
        shape = data.pop("routed_experts_shape", None)
        dtype = np.dtype(data.pop("routed_experts_dtype", "int32"))
        if data.get("routed_experts") is not None:
            if shape is None:
                raise ValueError("Sample dict has routed_experts but no routed_experts_shape")
            if dtype not in ROUTING_DTYPES:
                raise ValueError(f"Sample dict has routed_experts_dtype={dtype.name!r}: use uint8, int16 or int32")
            rows = _unpack(data["routed_experts"], dtype.newbyteorder("<"), shape[1], shape[2])
            data["routed_experts"] = rows.astype(dtype)  # native byte order
        # rollout.json files written before versions were integers hold them as strings ("3")
        data["weight_versions"] = [None if v is None else int(v) for v in data.get("weight_versions", [])]
        # ... and those written before segments were fields hold them in the metadata
        metadata = dict(data.get("metadata", {}))
        for field, key in (("segments", "num_segments"), ("request_ids", "rids"), ("restarts", "restarts")):
            if key in metadata and field not in data:
                data[field] = metadata.pop(key)
        data["metadata"] = metadata
        return cls(**data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        mine, theirs = dataclasses.asdict(self), dataclasses.asdict(other)
        a, b = mine.pop("routed_experts"), theirs.pop("routed_experts")
        same_routing = (a is None and b is None) or (
            a is not None and b is not None and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        )
        return mine == theirs and same_routing
