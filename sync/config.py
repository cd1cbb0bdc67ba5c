"""The weight sync's options and results: `SyncConfig` (full weights, `sync.sender`),
`AdapterSyncConfig` (LoRA adapters only, `sync.lora`), the names each option accepts, and
`SyncStats`, what one update of either kind reports. Each config checks its fields when built."""

from __future__ import annotations

from dataclasses import dataclass, field

from sync.delta import DELTA_ENCODINGS, DeltaStats
from sync.transports.base import TransportConfig

ADAPTER_ROUTES = ("disk", "tensors")

PAUSE_MODES = ("abort", "retract", "in_place", "none")
"""`sync.pause_mode`: SGLang's three `/pause_generation` modes, or "none": no pause at all, for
engines that stage a version beside the served one and swap at the commit (`stages_versions`)."""


@dataclass(kw_only=True)
class DeltaConfig:
    """Delta sync (`sync.delta`): each sending rank keeps the bytes it last sent of its own tensors,
    in the engine's format (after the HF conversion and FP8 quantization), and sends only the
    elements that changed bitwise, on a version chain every engine verifies."""

    enabled: bool = False
    full_every: int = 50
    """A full anchor every this many versions (also at the start, and whenever an engine needs one:
    it joined, restarted, or refused a delta)."""
    encoding: str = "auto"
    """"auto" picks per bucket by density: position gaps (sparse), a bitmap (denser), dense
    (most elements changed); or force one of "gaps", "bitmap", "dense"."""
    density: float = 0.01
    """The changed fraction `moe-rl plan` models (`moe-rl bench sync` measures it: ~1% at RL
    learning rates, see docs/sync.md); the sync itself never reads it."""

    def __post_init__(self):
        if not isinstance(self.full_every, int) or self.full_every < 1:
            raise ValueError(f"delta.full_every: {self.full_every!r} must be an integer >= 1 (1 = always full)")
        if self.encoding not in DELTA_ENCODINGS:
            raise ValueError(f"delta.encoding: {self.encoding!r} is not one of {DELTA_ENCODINGS}")
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"delta.density: {self.density!r} must be a fraction in (0, 1], e.g. 0.01")


@dataclass(kw_only=True)
class SyncConfig(TransportConfig):
    transport: str = "broadcast"
    """How bytes move: "broadcast" (process group), "disk" (safetensors on shared storage),
    "cuda_ipc" (colocated engines: CUDA-IPC handles via /update_weights_from_tensor)."""
    pause_mode: str = "retract"
    """`/pause_generation` mode: abort | retract | in_place (SGLang's), or none: the engines keep
    generating while the buckets arrive and swap the version in between two forwards at the commit
    (engines that `stages_versions`: the embedded engine; SGLang loads buckets into the live model)."""
    fp8_blocks: int | None = None
    """Send decoder linear weights as FP8 e4m3 in N x N blocks with their `weight_scale_inv`
    (DeepSeek-V3's format, N=128: half the bytes of bf16), for engines that serve FP8; the engines
    then start from an FP8 checkpoint too. None: the trainer's dtype."""
    stage_groups: bool = True
    """With pipeline parallelism: one weight-update group per stage (`{group_name}_pp{stage}`), each
    stage's source broadcasting its own layers, stage after stage (`sync.stages`); false: every
    stage's tensors funnel to the first stage's source, which broadcasts them all (`sync.pipeline`)."""
    relays: int | None = None
    """Trainer ranks on the sync root's node that join each weight-update group behind the root
    (engines then start at rank_offset 1 + relays), so NCCL rings the broadcast through their NICs
    too (`sync.relay`). None: every other GPU of the root's node with nccl (up to
    cluster.nics_per_node - 1), none with gloo; 0: none."""
    delta: DeltaConfig = field(default_factory=DeltaConfig)
    """Send only what changed since the last version (`sync.delta`); full-weight sync only."""
    lora_route: str = "tensors"
    """With `lora:`, only adapters move and generation never pauses (`sync.lora`): "tensors"
    (`/load_lora_adapter_from_tensors`) or "disk" (PEFT directories `policy-v{N}/` in `disk_dir`,
    default `<output_dir>/adapters`, for engines that share only storage with the trainer)."""

    def __post_init__(self):
        super().__post_init__()
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode: {self.pause_mode!r} is not one of {PAUSE_MODES}")
        if self.fp8_blocks is not None and (not isinstance(self.fp8_blocks, int) or self.fp8_blocks < 1):
            raise ValueError(f"fp8_blocks: {self.fp8_blocks!r} is not a block size; use e.g. 128, or null")
        if self.relays is not None and (not isinstance(self.relays, int) or self.relays < 0):
            raise ValueError(f"relays: {self.relays!r} is not a count of ranks; use 0 (none), 7, or null (auto)")
        if self.lora_route not in ADAPTER_ROUTES:
            raise ValueError(f"lora_route: {self.lora_route!r} is not one of {ADAPTER_ROUTES}")


@dataclass(kw_only=True)
class AdapterSyncConfig:
    route: str = "tensors"
    """"tensors": `/load_lora_adapter_from_tensors` over HTTP; "disk": a PEFT directory on storage
    the engines share (`directory`), loaded with `/load_lora_adapter`."""
    directory: str | None = None
    """Where the disk route writes `policy-v{N}/` (must be readable by every engine)."""
    keep: int = 2
    """Versions loaded at once: max_staleness + 1 (the oldest request may still use the oldest)."""
    timeout_s: float = 300.0
    """Bound on each engine call."""

    def __post_init__(self):
        if self.route not in ADAPTER_ROUTES:
            raise ValueError(f"lora route: {self.route!r} is not one of {ADAPTER_ROUTES}")
        if self.route == "disk" and not self.directory:
            raise ValueError("the disk adapter route needs a directory the engines can read")
        if self.keep < 1:
            raise ValueError(f"keep={self.keep}: at least one adapter must stay loaded")


@dataclass
class SyncStats:
    """What one update (`WeightSender.update`, `AdapterSync.publish`) moved and to whom."""

    version: int
    bytes: int
    seconds: float
    engines: list[str] = field(default_factory=list)
    """The engines that committed `version`."""
    dropped: list[str] = field(default_factory=list)
    """Engines found dead (they could not resume) and dropped during this update."""
    phases: list[tuple[str, float, float]] = field(default_factory=list)
    """(phase, start, end) in wall-clock seconds (`time.time()`, for a timeline): pause, buckets
    (buckets), commit, resume."""
    delta: DeltaStats | None = None
    """With `sync.delta`: what the update carried (an anchor or a delta, changed elements, the
    tensors' own bytes against the bytes sent)."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0
