"""The benchmarks' options: one kw-only dataclass per `moe-rl bench` command, checked when built.

The command modules take their defaults from here to build the CLI's parser, so this module
imports nothing heavy (no torch); `moe_rl.commands.options_from` builds an options object from the
parsed arguments, `moe_rl.config.load_config(path, cls=SyncBench)` one from a YAML file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel.layout import ParallelLayout

DELTA_FORMATS = ("bf16", "fp8")


def _positive(options, *names: str) -> None:
    for name in names:
        value = getattr(options, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name.replace('_', '-')}={value!r}: must be a positive integer")


@dataclass(frozen=True, kw_only=True)
class EngineBench:
    """`moe-rl bench engine` (`moe_rl.bench.engine`)."""

    model_dir: str | None = None
    """HF MoE model directory; None: a tiny random Qwen3-MoE."""
    url: str | None = None
    """A running engine (SGLang or embedded) to measure instead of starting one; the generate()
    baseline then needs `model_dir`, the model it serves."""
    requests: int = 32
    """Requests sent one after another, then all at once."""
    prompt_len: int = 32
    max_new_tokens: int = 64
    """Exactly this many new tokens per request (EOS ignored)."""
    repeats: int = 3
    """Concurrent + generate() pairs; the best of each is shown."""

    def __post_init__(self):
        _positive(self, "requests", "prompt_len", "max_new_tokens", "repeats")


@dataclass(frozen=True, kw_only=True)
class DeltaBench:
    """The `delta:` section of `moe-rl bench sync CONFIG` (`moe_rl.bench.delta`): a tiny model trained
    at RL learning rates, each step's served weights sent as a delta (`sync.delta`)."""

    lrs: list[float] = field(default_factory=lambda: [1.0e-6, 1.0e-5])
    """Adam learning rates, one run each per format (YAML needs the dot: 1.0e-6, not 1e-6)."""
    formats: list[str] = field(default_factory=lambda: list(DELTA_FORMATS))
    """Served formats: "bf16" (every tensor), "fp8" (decoder linear weights as FP8 blocks + scales)."""
    steps: int = 100
    """Optimizer steps per run, each followed by a sync."""
    full_every: int = 50
    """A full anchor at step 0 and every this many steps (DeltaConfig.full_every)."""
    encoding: str = "auto"
    """DeltaConfig.encoding: "auto", "gaps", "bitmap" or "dense"."""
    fp8_blocks: int = 32
    """FP8 block size (rows = cols); must divide the model's linear dims (128 on real models)."""
    batch_size: int = 16
    """Sequences per step."""
    seq_len: int = 32
    """Tokens per sequence."""
    seed: int = 0
    """Seeds the init and the batches: every run starts from the same weights, sees the same data."""

    def __post_init__(self):
        _positive(self, "steps", "full_every", "fp8_blocks", "batch_size", "seq_len")
        if not self.lrs or any(lr <= 0 for lr in self.lrs):
            raise ValueError(f"delta.lrs={self.lrs!r}: need positive learning rates, e.g. [1.0e-6, 1.0e-5]")
        if not self.formats or any(f not in DELTA_FORMATS for f in self.formats):
            raise ValueError(f"delta.formats={self.formats!r}: pick from {list(DELTA_FORMATS)}")


@dataclass(frozen=True, kw_only=True)
class SyncBench:
    """`moe-rl bench sync CONFIG` (`moe_rl.bench.sync`; with `lora`, `moe_rl.bench.lora`; with
    `delta`, `moe_rl.bench.delta`), read from YAML (configs/bench/sync_1g.yaml,
    configs/bench/sync_lora.yaml, configs/bench/sync_delta.yaml)."""

    model: dict
    """Qwen3MoeConfig fields of the random-init model."""
    layout: ParallelLayout
    """The trainer world (gloo ranks)."""
    bucket_mb: int = 128
    """The sync's bucket (the sender holds two)."""
    export_bucket_mb: int = 64
    """Gathered tensors the export holds at once (a larger tensor alone)."""
    num_engines: int = 2
    """Receiver-only engines (`sync.receiver_engine`)."""
    repeats: int = 3
    """Timed rounds, after the warm-up."""
    stage_groups: bool = True
    """With layout.pp > 1: one group per stage (false: the funnel)."""
    lora: dict | None = None
    """LoRAConfig fields: compare adapter and full-weight syncs to one embedded engine instead."""
    delta: DeltaBench | None = None
    """Measure delta sync instead (one process: `layout`, the buckets and the engines are unused)."""
    output: str | None = None
    """The JSON written; None: bench_sync.json (bench_sync_lora.json with `lora`, bench_sync_delta.json
    with `delta`)."""

    def __post_init__(self):
        _positive(self, "bucket_mb", "export_bucket_mb", "num_engines", "repeats")
        if self.lora is not None and self.delta is not None:
            raise ValueError("lora and delta: the bench measures one of them; drop one section")

    @property
    def output_path(self) -> str:
        if self.output:
            return self.output
        if self.lora is not None:
            return "bench_sync_lora.json"
        return "bench_sync_delta.json" if self.delta is not None else "bench_sync.json"


@dataclass(frozen=True, kw_only=True)
class AsyncBench:
    """`moe-rl bench async CONFIG` (`moe_rl.bench.asynchrony`)."""

    config: str
    """RL run config (YAML with a rollout section)."""
    overrides: tuple[str, ...] = ()
    """Dotted overrides applied to every run."""
    steps: int = 20
    """RL steps per run."""
    balanced_max_new_tokens: int = 44
    """Response length of the balanced workload (generation ~ training in sync mode)."""
    long_tail_max_new_tokens: int = 56
    num_stop_tokens: int = 8
    """Stop tokens of the long-tailed task (8 of 256: mean length ~27, ~17% run to the budget)."""
    long_tail_staleness: int = 1
    """Staleness bound of the partial-rollout run (drain-before-sync is always 1); 2 carries
    stragglers over into the next step."""
    pools: bool | None = None
    """Disjoint CPU pools: one trainer rank and one engine on cores of their own; None: on with
    >= 2 cores, unless the config sets cpu_pools."""
    repeats: int = 1
    """Run every pair this many times; ratios are then medians with their range."""
    tool_latency_s: float = 0.05
    """Agent configs: seconds each tool call takes (the task option latency_s)."""
    output: str = "runs/bench_async/results.json"

    def __post_init__(self):
        _positive(self, "steps", "balanced_max_new_tokens", "long_tail_max_new_tokens", "num_stop_tokens")
        _positive(self, "long_tail_staleness", "repeats")
        object.__setattr__(self, "overrides", tuple(self.overrides))


@dataclass(frozen=True, kw_only=True)
class TrainBench:
    """`moe-rl bench train CONFIG` (`moe_rl.bench.train`)."""

    config: str
    """Run config with trainer.max_tokens_per_microbatch (configs/bench/train_*.yaml)."""
    overrides: tuple[str, ...] = ()
    """Dotted overrides, e.g. trainer.max_tokens_per_microbatch=2048."""
    lengths: str = ""
    """The synthetic batch: rows=512,prompt=16,median=48,cap=384,sigma=1.0,seed=0 (any of them)."""
    steps: int = 3
    """Timed train steps per path, after one warm-up."""
    output: str = "bench_train.json"

    def __post_init__(self):
        _positive(self, "steps")
        object.__setattr__(self, "overrides", tuple(self.overrides))
