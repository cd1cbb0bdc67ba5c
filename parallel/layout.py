"""The parallel layout of a Megatron world: TP, PP, EP, ETP, derived DP, microbatching.

`ParallelLayout` is pure data plus validation; it imports nothing from megatron, so a config
can be checked (and rejected with a clear message) before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

CP_COMM_TYPES = ("p2p", "all_gather", "a2a")
"""Transformer Engine's context-parallel communication kinds that `ParallelLayout.cp_comm_type` takes."""


@dataclass(kw_only=True, frozen=True)
class ModelShape:
    """The model dimensions a layout must divide. Filled from the HF config by the bridge."""

    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    num_experts: int  # 0 for a dense model
    vocab_size: int


@dataclass(kw_only=True)
class ParallelLayout:
    """How the trainer's ranks split the model.

    Megatron's order: the dense part is world = TP x CP x DP x PP (ranks ordered tp fastest, then
    cp, dp, pp); the expert part is world = ETP x EP x EDP x PP (EDP derived), so EP groups are
    formed across the DP x CP ranks of a stage.
    """

    config_name: ClassVar[str] = "layout"
    """How errors name this section (a run config calls it `trainer`)."""

    world_size: int = 1
    """Total trainer ranks (gloo processes on CPU, GPUs on a cluster)."""
    tp: int = 1
    """Tensor parallel size for attention and dense layers."""
    pp: int = 1
    """Pipeline parallel size (stages, each a contiguous range of layers)."""
    cp: int = 1
    """Context parallel size: each sequence is cut into 2 x cp chunks and CP rank r holds chunks r
    and 2cp-1-r (megatron-core's load-balanced split), so activations and attention compute per
    rank fall by cp; attention gathers keys and values over the CP group."""
    cp_comm_type: str = "p2p"
    """How Transformer Engine's attention communicates over the CP group (megatron-core's
    cp_comm_type): "p2p" (a ring of key/value blocks overlapped with compute, megatron's default),
    "all_gather" (keys and values gathered whole) or "a2a" (all-to-all of heads, Ulysses-style: needs
    the heads per TP rank divisible by cp). All compute the same attention; MLA (DeepSeek-V3, q/k and
    v head sizes differ) needs a TE whose p2p ring takes them, else "a2a" or "all_gather". The CPU
    eager attention always gathers."""
    ep: int = 1
    """Expert parallel size: experts are split into `ep` groups."""
    etp: int | None = None
    """Expert tensor parallel size; None means the same as `tp` (Megatron's default)."""
    sequence_parallel: bool = False
    """Split activations along the sequence over TP; required for MoE with TP > 1."""
    micro_batch_size: int = 1
    """Sequences per microbatch on one DP rank."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all DP ranks (= micro x microbatches x DP); None
    means one microbatch per DP rank."""

    def __post_init__(self):
        if self.global_batch_size is None:
            self.global_batch_size = self.micro_batch_size * self.dp
        for name in ("world_size", "tp", "pp", "cp", "ep", "micro_batch_size", "global_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.config_name}.{name}={value!r}: must be a positive integer")
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"{self.config_name}.cp_comm_type={self.cp_comm_type!r}: use one of {list(CP_COMM_TYPES)}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError(f"{self.config_name}.etp={self.etp!r}: must be a positive integer or null")
        model_parallel = self.tp * self.cp * self.pp
        if self.world_size % model_parallel:
            raise ValueError(
                f"{self.config_name}.world_size={self.world_size} is not divisible by tp*cp*pp="
                f"{self.tp}*{self.cp}*{self.pp}={model_parallel}: change world_size to a multiple of "
                f"{model_parallel} or lower tp/cp/pp"
            )
        if self.world_size % (self.expert_tp * self.ep * self.pp):
            raise ValueError(
                f"{self.config_name}.world_size={self.world_size} is not divisible by etp*ep*pp="
                f"{self.expert_tp}*{self.ep}*{self.pp}: change world_size to a multiple of "
                f"{self.expert_tp * self.ep * self.pp} or lower ep/etp"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                f"{self.config_name}.sequence_parallel=true needs {self.config_name}.tp > 1: set it to false"
            )
        per_step = self.micro_batch_size * self.dp
        if self.global_batch_size % per_step:
            raise ValueError(
                f"{self.config_name}.global_batch_size={self.global_batch_size} is not divisible by "
                f"micro_batch_size*dp={self.micro_batch_size}*{self.dp}={per_step}: use a "
                f"multiple of {per_step}"
            )

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def dp(self) -> int:
        """Data parallel size of the dense part."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def expert_dp(self) -> int:
        """Data parallel size of the expert part."""
        return self.world_size // (self.expert_tp * self.ep * self.pp)

    @property
    def context_chunks(self) -> int:
        """The chunks CP cuts each sequence (each packed segment) into: 2 x cp, or 1 without CP."""
        return 2 * self.cp if self.cp > 1 else 1

    @property
    def sequence_multiple(self) -> int:
        """What a micro-batch's sequence length must be a multiple of: the CP chunks, each split
        over TP under sequence parallel."""
        return self.context_chunks * (self.tp if self.sequence_parallel else 1)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def check_model(self, shape: ModelShape) -> None:
        """Raise ValueError if this layout cannot split a model of `shape`."""
        if shape.num_attention_heads % self.tp:
            raise ValueError(
                f"{self.config_name}.tp={self.tp} does not divide the model's {shape.num_attention_heads} "
                f"attention heads: choose tp among {_divisors(shape.num_attention_heads)}"
            )
        if shape.num_query_groups % self.tp:
            raise ValueError(
                f"{self.config_name}.tp={self.tp} does not divide the model's {shape.num_query_groups} KV "
                f"groups (num_key_value_heads): choose tp among "
                f"{_divisors(shape.num_query_groups)}"
            )
        if self.cp > 1 and self.cp_comm_type == "a2a":
            for heads, what in ((shape.num_attention_heads, "attention heads"), (shape.num_query_groups, "KV groups")):
                if (heads // self.tp) % self.cp:
                    raise ValueError(
                        f"{self.config_name}.cp_comm_type='a2a' splits heads over cp={self.cp}, but each TP rank "
                        f"has {heads // self.tp} {what}: set {self.config_name}.cp_comm_type to 'p2p' or "
                        f"'all_gather', or a cp that divides {heads // self.tp}"
                    )
        if shape.num_layers % self.pp:
            raise ValueError(
                f"{self.config_name}.pp={self.pp} does not divide the model's {shape.num_layers} layers: "
                f"choose pp among {_divisors(shape.num_layers)}"
            )
        if shape.num_experts == 0:
            if self.ep > 1:
                raise ValueError(f"{self.config_name}.ep={self.ep} but the model has no experts: set ep=1")
            return
        if shape.num_experts % self.ep:
            raise ValueError(
                f"{self.config_name}.ep={self.ep} does not divide the model's {shape.num_experts} experts: "
                f"choose ep among {_divisors(shape.num_experts)}"
            )
        if self.tp > 1 and not self.sequence_parallel:
            raise ValueError(
                f"{self.config_name}.tp={self.tp} with an MoE model requires sequence parallel "
                f"(Megatron's MoE dispatch): set {self.config_name}.sequence_parallel=true"
            )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
