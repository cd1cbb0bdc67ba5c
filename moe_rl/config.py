"""Typed run configuration: nested kw-only dataclasses loaded from YAML + dotted overrides.

`load_config("cfg.yaml", ["trainer.tp=2"])` returns a validated `RunConfig`; every error is a
ValueError that names the field (e.g. `trainer.tp`) and the fix, raised before any process
starts. Components receive the sub-config they need, never the whole tree.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from moe_rl.agents.config import EpisodeConfig
from moe_rl.algorithms.config import AlgorithmConfig
from moe_rl.conversion.directory import HF_FILES_DIR, is_converted, read_meta
from moe_rl.cpu_pools import CpuPoolsConfig
from moe_rl.engine.sglang_options import check_options
from moe_rl.rollout.config import RolloutConfig
from moe_rl.rollout.eval_config import EvalConfig
from parallel.bridges import Bridge, bridge_for, without_mtp
from parallel.hf_checkpoint import as_stored
from parallel.layout import ParallelLayout
from parallel.lora import LoRAConfig
from parallel.model import PRECISIONS
from parallel.router import RouterTraining
from sync.config import SyncConfig


@dataclass(kw_only=True)
class ModelConfig:
    """Which model to train: an HF directory, or an inline HF config for a random-init model."""

    path: str | None = None
    """HF model directory (config.json, optionally safetensors weights and a tokenizer), or a
    checkpoint `moe-rl convert hf-to-megatron` wrote (loaded at any layout, `moe_rl.conversion.directory`)."""
    hf_config: dict[str, Any] | None = None
    """Inline HF config fields (with `model_type` and `architectures`) for a tiny random model."""
    tokenizer: str | None = None
    """Directory of the tokenizer (and its chat template) when it is not model.path's, e.g. the
    tiny chat tokenizer `configs/tokenizers/tiny_chat` for an inline hf_config."""
    mtp: str | None = None
    """Multi-token-prediction layers (DeepSeek-V3, GLM-4.5: num_nextn_predict_layers). Unset: they
    are megatron-core's MTP block on the last pipeline stage, exported and synced with the rest
    under their HF names (trained with trainer.mtp_loss_weight > 0). "drop": skipped on import with
    a warning; exports and weight syncs then carry a model without them (num_nextn_predict_layers:
    0), so engines cannot speculate with them."""

    def __post_init__(self):
        if self.mtp not in (None, "drop"):
            raise ValueError(f"model.mtp={self.mtp!r}: the only choice is 'drop' (or leave it unset)")
        if (self.path is None) == (self.hf_config is None):
            raise ValueError("model: set exactly one of model.path (HF dir) or model.hf_config")
        if self.path is not None and is_converted(self.path):
            read_meta(self.path)  # weights present, a model (not adapters)
        elif self.path is not None and not (Path(self.path) / "config.json").is_file():
            raise ValueError(
                f"model.path={self.path!r}: no config.json there; point it at an HF model dir or a "
                "`moe-rl convert hf-to-megatron` checkpoint"
            )
        if self.tokenizer is not None and not Path(self.tokenizer).is_dir():
            raise ValueError(f"model.tokenizer={self.tokenizer!r}: not a directory; point it at a tokenizer directory")
        if self.hf_config is not None:
            for key in ("model_type", "architectures"):
                if key not in self.hf_config:
                    raise ValueError(
                        f"model.hf_config lacks {key!r} (e.g. model_type: qwen3_moe, "
                        f"architectures: [Qwen3MoeForCausalLM])"
                    )

    @property
    def tokenizer_dir(self) -> str | None:
        """Where the tokenizer lives: model.tokenizer, else model.path (a converted checkpoint's
        `hf_files/`)."""
        if self.tokenizer is None and self.path is not None and is_converted(self.path):
            return str(Path(self.path) / HF_FILES_DIR)
        return self.tokenizer or self.path

    @property
    def model_type(self) -> str:
        """The HF `model_type` (of hf_config, config.json or a converted checkpoint's), read without
        transformers."""
        if self.hf_config is not None:
            return self.hf_config["model_type"]
        if is_converted(self.path):
            return read_meta(self.path)["hf_config"]["model_type"]
        return json.loads((Path(self.path) / "config.json").read_text())["model_type"]

    def load_hf_config(self):
        """The transformers config object (reads config.json; no weights)."""
        # heavy: transformers, only where an HF config, model or tokenizer is read
        from transformers import AutoConfig

        if self.path is not None and not is_converted(self.path):
            config = as_stored(AutoConfig.from_pretrained(self.path), self.path)
        else:
            fields = dict(self.hf_config if self.path is None else read_meta(self.path)["hf_config"])
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        if self.mtp == "drop":
            config = without_mtp(config)
        return config


@dataclass(kw_only=True)
class OptimizerConfig:
    """Megatron's Adam optimizer. Its state is fp32 in either trainer.precision: with bf16 it keeps
    fp32 main parameters beside the model's bf16 ones and steps those."""

    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Clip the global grad norm (over all ranks) to this value; 0 disables clipping."""
    distributed: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron's distributed optimizer)."""

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"optimizer.lr={self.lr}: must be > 0")
        if self.clip_grad < 0:
            raise ValueError(f"optimizer.clip_grad={self.clip_grad}: must be >= 0 (0 disables)")


@dataclass(kw_only=True)
class MoEConfig:
    """How the MoE routers train in RL (docs/trainer.md, "Router controls"). Today's defaults: the
    router weights train; no load-balancing loss and no expert-bias update move the routing."""

    freeze_router: bool = False
    """Router weights (HF `mlp.gate.weight`) and expert biases (`mlp.gate.e_score_correction_bias`)
    stay as loaded: no gradient, no optimizer state, no bias update; exports and weight syncs carry
    them unchanged, so the engines keep routing as the loaded model does (verl's default for Qwen
    MoE; NeMo-RL, prime-rl and SkyRL's `freeze_moe_router`)."""
    router_bias_update_rate: float = 0.0
    """Each optimizer step moves every expert bias by this much towards balance (DeepSeek-V3's
    auxiliary-loss-free balancing, megatron-core's `moe_router_bias_update_rate`), from the tokens
    the step routed to each expert. Models with an expert bias only (DeepSeek-V3, GLM-4.5);
    0: the bias stays as loaded (NeMo-RL's RL default)."""
    aux_loss_coeff: float = 0.0
    """Weight of megatron-core's load-balancing loss (`moe_aux_loss_coeff`), of the kind the model was
    pre-trained with: sequence-level for DeepSeek-V3 and GLM-4.5, batch-level for Qwen3-MoE and
    Mixtral. 0: no load-balancing loss."""

    def __post_init__(self):
        for name in ("router_bias_update_rate", "aux_loss_coeff"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"trainer.moe.{name}={value!r}: must be a number >= 0 (0 = off)")
        if self.freeze_router and self.router_bias_update_rate:
            raise ValueError(
                f"trainer.moe.freeze_router=true with trainer.moe.router_bias_update_rate="
                f"{self.router_bias_update_rate}: a frozen router keeps its expert bias as loaded; set "
                "router_bias_update_rate: 0, or freeze_router: false"
            )

    def check_model(self, bridge: Bridge) -> None:
        """Refuse settings the model (its bridge) cannot take."""
        if self.router_bias_update_rate and not bridge.has_expert_bias:
            raise ValueError(
                f"trainer.moe.router_bias_update_rate={self.router_bias_update_rate}, but "
                f"{bridge.architectures[0]} routers have no expert bias (e_score_correction_bias; "
                "DeepSeek-V3 and GLM-4.5 do): set trainer.moe.router_bias_update_rate: 0"
            )

    def router(self) -> RouterTraining:
        """These settings as `parallel.model.build_gpt_model` takes them."""
        return RouterTraining(
            freeze=self.freeze_router, bias_update_rate=self.router_bias_update_rate, aux_loss_coeff=self.aux_loss_coeff
        )


@dataclass(kw_only=True)
class TrainerConfig(ParallelLayout):
    """The Megatron trainer: its parallel layout (the inherited fields) plus training settings."""

    config_name: ClassVar[str] = "trainer"

    seed: int = 1234
    """Seed of every RNG (Megatron's tracker forks per TP/EP rank from it)."""
    precision: str = "fp32"
    """"fp32": parameters, activations and optimizer in fp32 (the CPU default). "bf16": mixed
    precision as Megatron-LM and slime train on GPUs: bf16 parameters and activations
    (megatron-core's Float16Module), fp32 main parameters and Adam state in the optimizer, gradients
    accumulated and reduced in fp32, logprobs and the loss from fp32 logits; exports, weight syncs
    and HF checkpoints carry the bf16 parameters the trainer computes with. Needed with
    pack_sequences on GPUs: Transformer Engine's attention runs packed sequences only in fp16/bf16
    (docs/trainer.md)."""
    recompute: bool = False
    """Full activation recompute of every layer (less memory, one more forward)."""
    routing_replay: bool = False
    """R3: replay the rollout's routed experts in the trainer's forward and in backward
    recompute (megatron-core's router replay), so training routes tokens as generation did."""
    no_replay_forward_every: int = 1
    """With routing_replay: every this many RL steps (logged steps N, 2N, ...) run one forward of
    the whole batch with routing off, recorded, for the `offpolicy/logprob_diff_no_replay_*` and
    `routing/agreement/*` metrics; `time/no_replay_forward_s` is its cost (one forward of the
    batch). 0 = never. Without routing_replay it is ignored."""
    consistency_probe_every: int = 10
    """Every this many RL steps (logged steps N, 2N, ...), after the weight sync, the consistency
    probe (`moe_rl.rl.consistency_probe`): an engine serving the trainer's version scores
    consistency_probe_samples of the step's sequences (prefill logprobs and routed experts of the
    exact ids) and the trainer runs the same ids, replaying that routing with routing_replay. Logs
    `consistency/probe/*`: train/inference mismatch on the same weights, where `offpolicy/*` adds
    the policy's movement (docs/algorithm.md); `time/consistency_probe_s` is its cost. 0 = never."""
    consistency_probe_samples: int = 4
    """Sequences the probe scores: that many of the batch's rows with trained tokens, evenly spaced
    (all of them when the batch has fewer)."""
    mtp_loss_weight: float = 0.0
    """Weight of the multi-token-prediction loss (megatron-core's mtp_loss_scaling_factor, split
    over the MTP layers; DeepSeek-V3 trained with 0.1-0.3): the MTP layers learn to predict the
    tokens the loss mask trains on, one more token ahead per layer, so engines that speculate with
    them keep up with the policy. 0: they are carried along untrained (frozen: no gradient, no
    optimizer state, no weight decay), exported and synced unchanged."""
    max_tokens_per_microbatch: int | None = None
    """Token-budget micro-batches: rows are balanced over DP ranks by length, each rank's rows are
    packed so that a micro-batch's rows x its longest row fit this many tokens, padded only to that
    row (docs/trainer.md). Must hold the longest sequence (prompt + rollout.max_new_tokens, or an
    episode's context): preflight refuses less. None: micro_batch_size rows at the batch's width."""
    pack_sequences: bool = False
    """Run each token-budget micro-batch packed: its rows' real tokens concatenated into one
    sequence (THD, megatron-core's PackedSeqParams with cu_seqlens), no padding between rows.
    Needs the Transformer Engine spec (GPUs with TE installed: the CPU local spec cannot pack) and
    max_tokens_per_microbatch (the plan is the same; docs/trainer.md). MTP layers follow the packing."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Router controls for RL: freezing, the expert-bias update, the load-balancing loss."""

    def __post_init__(self):
        super().__post_init__()
        if self.precision not in PRECISIONS:
            raise ValueError(f"trainer.precision={self.precision!r}: use one of {sorted(PRECISIONS)}")
        budget = self.max_tokens_per_microbatch
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 2):
            raise ValueError(f"trainer.max_tokens_per_microbatch={budget!r}: must be an integer >= 2 (tokens), or null")
        if self.pack_sequences and budget is None:
            raise ValueError(
                "trainer.pack_sequences=true packs the token-budget micro-batches: set "
                "trainer.max_tokens_per_microbatch too, or pack_sequences=false"
            )
        if not isinstance(self.no_replay_forward_every, int) or self.no_replay_forward_every < 0:
            raise ValueError(
                f"trainer.no_replay_forward_every={self.no_replay_forward_every!r}: must be an integer >= 0 "
                "(0 = never run the routing-off forward)"
            )
        for name, low in (("consistency_probe_every", 0), ("consistency_probe_samples", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(
                    f"trainer.{name}={value!r}: must be an integer >= {low} "
                    "(consistency_probe_every 0 = never probe; consistency_probe_samples: sequences per probe)"
                )
        if self.mtp_loss_weight < 0:
            raise ValueError(
                f"trainer.mtp_loss_weight={self.mtp_loss_weight}: must be >= 0 (0 leaves MTP layers untrained)"
            )

    def check_packing_precision(self, gpu_te: bool) -> None:
        """Refuse pack_sequences in fp32 where the model runs Transformer Engine's attention on GPUs
        (`gpu_te`): its flash and fused backends take only fp16/bf16, and it turns its unfused
        backend off for packed (thd) input, so no backend would run. (The CPU test stand-in packs in fp32.)"""
        if gpu_te and self.pack_sequences and self.precision == "fp32":
            raise ValueError(
                "trainer.pack_sequences=true with trainer.precision='fp32': Transformer Engine's attention "
                "runs packed (thd) sequences only in bf16/fp16 on GPUs. Set trainer.precision: bf16 "
                "(or pack_sequences: false)"
            )

    def check_context_parallel_precision(self, gpu_te: bool) -> None:
        """Refuse cp > 1 in fp32 where the model runs Transformer Engine's attention on GPUs (`gpu_te`):
        TE runs context parallelism only in its flash and fused backends, which take only fp16/bf16.
        (On CPU the local spec's eager attention and the test stand-in run CP in fp32.)"""
        if gpu_te and self.cp > 1 and self.precision == "fp32":
            raise ValueError(
                f"trainer.cp={self.cp} with trainer.precision='fp32': Transformer Engine runs context "
                "parallelism only in its flash and fused attention, in bf16/fp16 on GPUs. Set "
                "trainer.precision: bf16 (or cp: 1)"
            )


@dataclass(kw_only=True)
class DataConfig:
    """Supervised data: a JSONL file of {"input_ids": [...]} rows, or a seeded synthetic batch."""

    path: str | None = None
    """JSONL with one `input_ids` list per line; None means synthetic random tokens."""
    seq_length: int = 32
    """Tokens per training sequence (longer rows are cut, shorter ones padded and masked)."""

    def __post_init__(self):
        if self.seq_length < 2:
            raise ValueError(f"data.seq_length={self.seq_length}: must be >= 2")
        if self.path is not None and not Path(self.path).is_file():
            raise ValueError(f"data.path={self.path!r}: file not found")


ENGINE_KINDS = ("embedded", "sglang")
SPECULATIVE_ALGORITHMS = ("mtp",)


@dataclass(kw_only=True)
class SpeculativeConfig:
    """Speculative rollout with the model's MTP layer (docs/speculative.md): the layer drafts a
    chain of `steps` tokens, one forward of the policy verifies them, the standard acceptance rule
    keeps the output distribution the policy's. The draft is synced with the policy (same version)."""

    algorithm: str = "mtp"
    """"mtp": the first multi-token-prediction layer drafts (SGLang `--speculative-algorithm NEXTN`)."""
    steps: int = 2
    """Draft tokens per verifying forward, k (SGLang `--speculative-num-steps` k and
    `--speculative-num-draft-tokens` k + 1)."""

    def __post_init__(self):
        if self.algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"engines.speculative.algorithm={self.algorithm!r}: use one of {SPECULATIVE_ALGORITHMS}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or not 1 <= self.steps <= 8:
            raise ValueError(f"engines.speculative.steps={self.steps!r}: must be an integer in [1, 8]")


RL_MODES = ("sync", "one_step_off", "fully_async")


@dataclass(kw_only=True)
class EngineConfig:
    """The rollout engines (one Ray actor each, owning the server process)."""

    kind: str = "embedded"
    """"embedded" (the CPU engine, `moe-rl serve`) or "sglang" (GPU clusters)."""
    count: int = 1
    """Number of engine servers; generation is spread over them, groups stay on one engine."""
    max_batch: int = 64
    """Most requests one engine decodes together (SGLang `--max-running-requests`, the embedded
    engine's `--max-batch`)."""
    threads: int = 1
    """CPU threads per embedded engine process."""
    tp: int = 1
    """SGLang `--tp-size`: GPUs per engine (attention/dense layers split over them)."""
    ep: int = 1
    """SGLang `--ep-size`: experts split over this many of the engine's GPUs (divides tp)."""
    dp: int = 1
    """Must be 1: SGLang 0.5.23's `--dp-size` runs replicas behind one server, and its weight-update
    and LoRA routes assert dp_size == 1. More replicas: engines.count; DP attention: engines.attn_dp."""
    attn_dp: int = 1
    """SGLang `--attn-dp-size` (DP attention): attention replicated over attn_dp groups of tp/attn_dp GPUs."""
    mem_fraction_static: float = 0.85
    """SGLang `--mem-fraction-static`: share of GPU memory for weights + KV cache."""
    join_from: str | None = None
    """Where a restarted or added engine gets the committed version before it gets work: "peer" (a
    live engine sends it over a group of their own and the trainer keeps stepping: `moe_rl.rl.joins`)
    or "trainer" (its sender exports and sends the version again). None: "peer" for embedded
    engines, "trainer" for SGLang (0.5.23 has no route that sends weights). With `lora:` the
    trainer sends the adapters either way."""
    sglang: dict[str, Any] = field(default_factory=dict)
    """Any other SGLang 0.5.23 server option, by its flag's name: {moe_a2a_backend: deepep,
    kv_cache_dtype: fp8_e4m3, chunked_prefill_size: 8192, enable_eplb: true, ...}. Checked before
    start against the table of SGLang's options (`moe_rl.engine.sglang_options`); the ones moe-rl
    sets itself are refused with the field that owns them."""
    speculative: SpeculativeConfig | None = None
    """Speculative rollout with the model's MTP layer ({algorithm: mtp, steps: k}); None: off."""

    def __post_init__(self):
        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"engines.kind={self.kind!r}: use one of {ENGINE_KINDS}")
        for name in ("count", "max_batch", "threads", "tp", "ep", "dp", "attn_dp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"engines.{name}={getattr(self, name)!r}: must be an integer >= 1")
        if self.dp > 1:
            raise ValueError(
                f"engines.dp={self.dp}: SGLang 0.5.23's --dp-size runs replicas behind one server and its "
                "weight-update and LoRA routes assert dp_size == 1; for more replicas raise engines.count, "
                "for DP attention set engines.attn_dp (SGLang --attn-dp-size) and leave engines.dp at 1"
            )
        for name in ("ep", "attn_dp"):
            if self.tp % getattr(self, name):
                raise ValueError(
                    f"engines.{name}={getattr(self, name)} does not divide engines.tp={self.tp} "
                    f"(SGLang splits an engine's tp GPUs into {name} groups): make it a divisor"
                )
        if self.kind == "embedded" and self.gpus_per_engine > 1:
            raise ValueError(
                f"engines.tp={self.tp}: the embedded engine is one CPU process; set engines.tp: 1 "
                "or use engines.kind: sglang"
            )
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"engines.mem_fraction_static={self.mem_fraction_static}: must be in (0, 1)")
        if self.join_from not in (None, "peer", "trainer"):
            raise ValueError(f"engines.join_from={self.join_from!r}: use peer, trainer or leave it unset")
        if self.join_from == "peer" and self.kind != "embedded":
            raise ValueError(
                "engines.join_from=peer: SGLang 0.5.23 engines cannot send their weights to a peer; "
                "set engines.join_from: trainer (or leave it unset)"
            )
        if self.sglang and self.kind != "sglang":
            raise ValueError(
                f"engines.sglang={self.sglang}: SGLang server options with engines.kind={self.kind!r}; "
                "set engines.kind: sglang or remove them"
            )
        check_options(self.sglang, tp=self.tp, ep=self.ep)

    @property
    def gpus_per_engine(self) -> int:
        return self.tp

    @property
    def joins_from_peer(self) -> bool:
        return self.join_from == "peer" or (self.join_from is None and self.kind == "embedded")


@dataclass(kw_only=True)
class ClusterConfig:
    """The machines a run is placed on (read by `moe-rl plan`; Ray/SLURM own the real placement)."""

    nodes: int = 1
    """Nodes in the allocation."""
    gpus_per_node: int = 8
    """GPUs per node."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GB (1e9 bytes), e.g. 80 (H100), 141 (H200)."""
    param_dtype: str = "bfloat16"
    """Dtype of the engines' weights (`moe-rl plan` sizes the engines by it); the trainer's weights
    and the syncs it sends are in trainer.precision."""
    nic_gbps: float = 400.0
    """Bandwidth in Gb/s of one GPU's network card (400: InfiniBand NDR); `moe-rl plan` models the
    weight sync from the bytes each link carries (`moe_rl.plan.sync_links`)."""
    nics_per_node: int = 8
    """Network cards per node (one per GPU on H100/H200 nodes)."""
    nvlink_gbps: float = 3600.0
    """NVLink bandwidth in Gb/s of one GPU, one direction (3600 = 450 GB/s: H100/H200)."""
    link_gbps: float | None = None
    """Replaced by nic_gbps and nics_per_node (kept only to name them when set)."""

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"cluster.{name}={getattr(self, name)!r}: must be an integer >= 1")
        if self.gpu_memory_gb <= 0:
            raise ValueError(f"cluster.gpu_memory_gb={self.gpu_memory_gb}: must be > 0")
        if self.link_gbps is not None:
            raise ValueError(
                f"cluster.link_gbps={self.link_gbps:g}: replaced by cluster.nic_gbps (Gb/s of one GPU's "
                "network card, default 400) and cluster.nics_per_node (default 8); set those instead"
            )
        for name in ("nic_gbps", "nvlink_gbps"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"cluster.{name}={getattr(self, name):g}: must be > 0 (Gb/s, e.g. 400 for an "
                    "InfiniBand NDR NIC, 3600 for H100 NVLink)"
                )
        if not isinstance(self.nics_per_node, int) or self.nics_per_node < 1:
            raise ValueError(f"cluster.nics_per_node={self.nics_per_node!r}: must be an integer >= 1")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"cluster.param_dtype={self.param_dtype!r}: use one of {sorted(PARAM_DTYPES)}")

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


PARAM_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""Bytes per element of each supported parameter dtype."""


@dataclass(kw_only=True)
class RLConfig:
    """How generation and training overlap, and what the RL job writes at the end."""

    mode: str = "fully_async"
    """"sync": generate, train, sync (staleness 0, the baseline); "one_step_off": staleness 1,
    in-flight generation drains before each weight sync (no sample mixes versions);
    "fully_async": staleness `rollout.max_staleness` >= 1, generation only stops for the weight
    swap, requests cut by it resume as partial rollouts (pause_mode abort) or continue in place
    (in_place); with pause_mode none (embedded engines) it never stops: the swap falls between two
    forwards."""
    save_hf: bool = True
    """Write the final policy as an HF checkpoint (`final_hf/`) that the engines can serve."""
    report: bool = True
    """Write the PNG plots of `moe-rl report` into `plots/` at the end."""
    wandb_project: str | None = None
    """Also log to Weights & Biases under this project (needs `pip install wandb`)."""
    checkpoint_every: int = 0
    """Write a run checkpoint (`moe_rl.rl.resume`) every this many steps and at the end; 0: never."""
    keep_checkpoints: int = 2
    """Run checkpoints kept (the newest); older ones are deleted after each new one is complete."""
    checkpoint_background: bool = True
    """The trainer's part of a run checkpoint is written by background writers (megatron-core's
    async dist checkpointing) while training goes on; the checkpoint is put in place at a later
    step, when they are done. False: each checkpoint is written before the next step starts."""
    trace_steps: int = 5
    """Record this many steps after the first as a timeline of every process's spans
    (`RUN_DIR/trace.json`, Chrome/Perfetto format; `plots/timeline.png`); 0: off."""
    max_restarts: int = 3
    """Trainer faults survived in the job: when a trainer rank dies or misses `call_timeout_s`, the
    driver tears the run's processes down and resumes from the newest run checkpoint (step 0
    without one), as `--resume` would; the next fault ends the run. 0: the first fault ends it."""
    call_timeout_s: float = 1800.0
    """Deadline of every call to the trainer ranks (build, step, weight sync, checkpoint): a rank
    that has not answered by then is named, its stacks dumped (`moe-rl stacks`), and the trainer
    restarted (`max_restarts`) or the run ended with that message."""
    stop_grace_s: float = 240.0
    """After SIGTERM / SIGUSR1 the run checkpoints at the end of the step under way and exits 75;
    if that takes longer than this, or a second signal comes, it exits at once (the newest complete
    checkpoint stays intact). Keep it under SLURM's `--signal` lead time."""
    colocate: bool = False
    """Engines share the trainer's GPUs: each step the engines generate, pause and release their
    weights and KV cache (`/release_memory_occupation`), the trainer trains, the engines resume
    and the trainer re-syncs every weight (`moe_rl.rl.colocate`). Only with mode 'sync'."""

    def __post_init__(self):
        if self.mode not in RL_MODES:
            raise ValueError(f"rl.mode={self.mode!r}: use one of {RL_MODES}")
        if self.colocate and self.mode != "sync":
            raise ValueError(
                f"rl.colocate=true with rl.mode={self.mode!r}: colocated engines release their memory "
                "while the trainer trains, so generation cannot overlap training; set rl.mode: sync "
                "or rl.colocate: false"
            )
        if self.checkpoint_every < 0:
            raise ValueError(f"rl.checkpoint_every={self.checkpoint_every}: must be >= 0 (0 disables)")
        if self.keep_checkpoints < 1:
            raise ValueError(f"rl.keep_checkpoints={self.keep_checkpoints}: must be >= 1")
        if self.max_restarts < 0:
            raise ValueError(f"rl.max_restarts={self.max_restarts}: must be >= 0 (0: a trainer fault ends the run)")
        for name in ("call_timeout_s", "stop_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"rl.{name}={getattr(self, name)}: must be > 0 seconds")
        if not isinstance(self.trace_steps, int) or self.trace_steps < 0:
            raise ValueError(f"rl.trace_steps={self.trace_steps!r}: must be an integer >= 0 (0 turns the trace off)")

    def staleness(self, rollout: RolloutConfig) -> int:
        """The staleness bound this mode trains with."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, rollout.max_staleness)

    @property
    def drain_before_sync(self) -> bool:
        return self.mode == "one_step_off"


@dataclass(kw_only=True)
class RunConfig:
    """One `moe-rl train` run: supervised without a `rollout` section, RL with one."""

    model: ModelConfig
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    output_dir: str = "runs/default"
    """Where metrics, checkpoints and plots go."""
    steps: int = 10
    """Optimizer steps."""
    save_checkpoint: bool = True
    """Save a Megatron dist checkpoint (model, optimizer, RNG) at the end."""
    rollout: RolloutConfig | None = None
    """RL: what to generate and how stale it may be. Present = `moe-rl train` runs the RL job."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """RL: the policy objective (advantages, clipping, off-policy correction)."""
    sync: SyncConfig = field(default_factory=lambda: SyncConfig(bucket_bytes=64 << 20))
    """RL: trainer -> engine weight sync (transport, bucket size, pause mode)."""
    engines: EngineConfig = field(default_factory=EngineConfig)
    """RL: the rollout engines."""
    rl: RLConfig = field(default_factory=RLConfig)
    """RL: the loop's mode and end-of-run outputs."""
    cluster: ClusterConfig | None = None
    """The GPU allocation (`moe-rl plan` places the trainer and engines on it); None on CPU."""
    lora: LoRAConfig | None = None
    """Adapter-only training (parallel.lora): the base is frozen; RL syncs only the adapters, one
    `policy-v{N}` per version, without pausing generation (sync.lora). None: full fine-tuning."""
    eval: EvalConfig | None = None
    """RL: held-out evaluation every `eval.every` steps on the rollout engines (pass@k, dumps);
    also what `moe-rl eval CONFIG --checkpoint DIR` runs. None: no evaluation."""
    cpu_pools: CpuPoolsConfig | None = None
    """RL on CPU: pin the trainer ranks and each embedded engine to cores of their own
    (`moe_rl.cpu_pools`). None: no pinning (every process may run on every core)."""

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: must be >= 1")

        bridge = bridge_for(self.model.load_hf_config())
        if self.engines.speculative is not None and not bridge.mtp_layers:
            raise ValueError(
                "engines.speculative: the model has no MTP layer to draft with (num_nextn_predict_layers "
                "is 0, or model.mtp: drop); use a DeepSeek-V3 / GLM-4.5 model with its MTP layer, or "
                "remove engines.speculative"
            )
        self.trainer.check_model(bridge.model_shape())
        self.trainer.moe.check_model(bridge)
        if self.rollout is not None:
            self._check_rl()
            self.rollout.episode = self._episode(self.rollout.episode)
        if self.cpu_pools is not None:
            self.cpu_pools.check(self.trainer.world_size, self.engines.count, self.engines.kind)
        if self.cluster is not None:
            self._check_cluster()

    @property
    def is_rl(self) -> bool:
        return self.rollout is not None

    @property
    def rollout_or_default(self) -> RolloutConfig:
        """`rollout`, or the defaults an eval-only config (`moe-rl eval`) runs its datasets with."""
        return self.rollout or RolloutConfig(episode=self._episode(EpisodeConfig()))

    def _episode(self, episode: EpisodeConfig) -> EpisodeConfig:
        """`episode` with its "auto" chat formats resolved for the model, when agents run."""
        sources = ([self.rollout] if self.rollout else []) + (self.eval.datasets if self.eval else [])
        episodes = any(s.agent or (s.environment is not None and s.environment.episodes) for s in sources)
        return episode.resolved(self.model.model_type) if episodes else episode

    def _check_rl(self) -> None:
        rollout, mode = self.rollout, self.rl.mode
        rows = rollout.groups_per_step * rollout.n_samples_per_prompt
        if self.trainer.global_batch_size != rows:
            raise ValueError(
                f"trainer.global_batch_size={self.trainer.global_batch_size} but one RL step trains "
                f"rollout.groups_per_step x n_samples_per_prompt = {rows} sequences: make them equal"
            )
        per_step = self.algorithm.num_mini_batches * self.trainer.micro_batch_size * self.trainer.dp
        if rows % per_step:
            raise ValueError(
                f"algorithm.num_mini_batches={self.algorithm.num_mini_batches}: each of the {rows} sequences' "
                f"mini-batches must hold a multiple of micro_batch_size x dp = {self.trainer.micro_batch_size} x "
                f"{self.trainer.dp} sequences; choose a divisor of "
                f"{rows // (self.trainer.micro_batch_size * self.trainer.dp)}"
            )
        if mode == "fully_async" and rollout.max_staleness < 1:
            raise ValueError(
                "rl.mode='fully_async' with rollout.max_staleness=0: set max_staleness >= 1, or use rl.mode='sync'"
            )
        self.algorithm.check_staleness(self.rl.staleness(rollout))
        if self.trainer.routing_replay and not rollout.return_routed_experts:
            raise ValueError(
                "trainer.routing_replay needs the engines' routing: set rollout.return_routed_experts: true"
            )
        if self.sync.transport == "cuda_ipc" and not self.rl.colocate:
            raise ValueError(
                "sync.transport='cuda_ipc' needs engines on the trainer's GPUs: set rl.colocate: true, "
                "or use broadcast or disk"
            )
        if self.sync.transport == "cuda_ipc" and self.engines.count > 1:
            # the IPC buffer lives on the sync source's GPU; engine i > 0 runs on other GPUs
            raise ValueError(
                f"sync.transport='cuda_ipc' with engines.count={self.engines.count}: CUDA-IPC buckets "
                "live on the sync source's GPU, which only engine 0 sees; use one engine or "
                "sync.transport: broadcast"
            )
        if self.sync.delta.enabled:
            self._check_delta()
        if self.lora is not None and self.rl.colocate:
            raise ValueError(
                "lora with rl.colocate: adapter sync keeps engines generating while the trainer "
                "trains; colocated engines release their GPUs instead. Set rl.colocate: false"
            )
        if self.lora is not None and self.algorithm.ref_model_path is not None:
            raise ValueError(
                f"algorithm.ref_model_path={self.algorithm.ref_model_path!r} with lora: the KL reference of a "
                "LoRA run is the frozen base, the policy with its adapters off (no second model); remove "
                "ref_model_path"
            )
        distill = self.algorithm.distill
        if distill is not None and distill.mode == "pure" and rollout.drop_zero_variance_groups:
            raise ValueError(
                "algorithm.distill.mode='pure' with rollout.drop_zero_variance_groups: the teacher's "
                "per-token signal is the advantage, so an all-equal-reward group still teaches; set "
                "drop_zero_variance_groups: false (or distill.mode: add)"
            )
        if self.sync.pause_mode == "none" and self.engines.kind != "embedded":
            raise ValueError(
                f"sync.pause_mode='none' with engines.kind={self.engines.kind!r}: only embedded engines keep "
                "generating through a weight update (they stage the version beside the served one; SGLang loads "
                "buckets into the live model); use pause_mode abort, retract or in_place"
            )
        if self.sync.pause_mode == "none" and self.rl.colocate:
            raise ValueError(
                "sync.pause_mode='none' with rl.colocate: colocated engines stop to give the trainer their "
                "memory, so nothing generates through the update; use pause_mode abort"
            )
        if self.sync.pause_mode == "in_place" and self.sync.transport == "disk":
            # SGLang flushes the cache after a disk load and refuses while paused requests run
            raise ValueError(
                "sync.pause_mode='in_place' with sync.transport='disk': SGLang's disk update "
                "flushes the KV cache, refused while in-place-paused requests run; use "
                "pause_mode abort or retract, or transport broadcast"
            )

    def _check_delta(self) -> None:
        """`sync.delta` goes where a delta travels (the engines' side: `check_sync` in preflight)."""
        if self.lora is not None:
            raise ValueError(
                "sync.delta.enabled with lora: only the adapters move (a few MB), deltas are for "
                "full-weight sync; set sync.delta.enabled: false"
            )
        if self.sync.transport not in ("broadcast", "disk"):
            raise ValueError(
                f"sync.delta.enabled with sync.transport={self.sync.transport!r}: deltas travel in "
                "broadcast buckets or as delta files on shared storage; use sync.transport: broadcast "
                "or disk, or set sync.delta.enabled: false"
            )

    def _check_cluster(self) -> None:
        trainer, engines = self.trainer.world_size, self.engines.count * self.engines.gpus_per_engine
        if self.is_rl and self.rl.colocate and engines > trainer:
            raise ValueError(
                f"rl.colocate: engines.count x engines.tp = {engines} GPUs but the trainer has "
                f"trainer.world_size={trainer}: colocated engines live on the trainer's GPUs; "
                "use fewer or smaller engines"
            )
        if self.is_rl and not self.rl.colocate and trainer + engines > self.cluster.total_gpus:
            raise ValueError(
                f"cluster: {self.cluster.nodes} nodes x {self.cluster.gpus_per_node} GPUs = {self.cluster.total_gpus} "
                f"GPUs, but trainer.world_size={trainer} + engines.count x engines.tp={engines} need "
                f"{trainer + engines}: raise cluster.nodes or shrink a pool"
            )
        if not self.is_rl and trainer > self.cluster.total_gpus:
            raise ValueError(
                f"trainer.world_size={trainer} exceeds the cluster's {self.cluster.total_gpus} GPUs: "
                "raise cluster.nodes or lower world_size"
            )

    def effective_rollout(self) -> RolloutConfig:
        """The rollout section with the staleness bound the mode implies."""
        staleness = self.rl.staleness(self.rollout)
        if staleness != self.rollout.max_staleness and self.rl.mode != "fully_async":
            warnings.warn(
                f"rl.mode={self.rl.mode!r} trains with staleness {staleness}; "
                f"rollout.max_staleness={self.rollout.max_staleness} is ignored"
            )
        return self.rollout.replace(max_staleness=staleness)


# -- loading --------------------------------------------------------------------------------
MOVED = {
    "algorithm.mask_stale_tokens": "rollout.mask_stale_tokens (tokens older than their sample's newest version)",
    "algorithm.drop_zero_variance_groups": "rollout.drop_zero_variance_groups (dropped and refilled at generation)",
}
"""Config keys that moved or were renamed -> where their setting lives now (a one-line refusal
names it; renamed values, such as the task "jsonl", are refused where they are read:
`moe_rl.tasks.registry.RENAMED_TASKS`)."""


def load_config(path: str | Path, overrides: list[str] = (), cls: type = RunConfig):
    """Read YAML, apply `a.b.c=value` overrides (values parsed as YAML), build and validate."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(
            f"config file {str(path)!r} is not valid YAML{where}: "
            f"{getattr(error, 'problem', None) or error}; fix the syntax there"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of sections (model:, trainer:, ...)")
    for override in overrides:
        apply_override(data, override)
    return from_dict(cls, data)


def apply_override(data: dict, override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ValueError(f"override {override!r}: write it as dotted.key=value, e.g. trainer.tp=2")
    *parents, leaf = key.strip().split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {override!r}: {part!r} is not a section")
    try:
        node[leaf] = yaml.safe_load(raw)
    except yaml.YAMLError as error:
        raise ValueError(f"override {override!r}: the value is not valid YAML ({error}); quote it") from None


def from_dict(cls: type, data: Any, prefix: str = ""):
    """Build dataclass `cls` from a dict, checking names and types field by field."""
    if not isinstance(data, dict):
        raise ValueError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        name = unknown[0]
        if prefix + name in MOVED:
            raise ValueError(f"config field {prefix + name!r} is now {MOVED[prefix + name]}: set that instead")
        close = difflib.get_close_matches(name, fields, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known: {sorted(fields)}"
        raise ValueError(f"unknown config field {prefix + name!r}{hint}")
    kwargs = {name: _convert(hints[name], value, f"{prefix}{name}") for name, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as error:  # a required field is missing
        raise ValueError(f"{prefix or 'config'}: {error}") from None


def _convert(hint: Any, value: Any, name: str):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        present = [o for o in options if o is not type(None)]
        if len(present) == 1:  # Optional[X]: X's own error names the field
            return _convert(present[0], value, name)
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, name)
            except ValueError:
                continue
        raise ValueError(f"{name}={value!r}: expected {_describe(hint)}")
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, prefix=f"{name}.")
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{name}={value!r}: expected a mapping")
        item = (typing.get_args(hint) or (Any, Any))[1]
        return {key: _convert(item, v, f"{name}.{key}") for key, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{name}={value!r}: expected a list")
        (item,) = typing.get_args(hint) or (Any,)
        return [_convert(item, v, f"{name}[{i}]") for i, v in enumerate(value)]
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and type(value) is not hint:
        raise ValueError(f"{name}={value!r}: expected {hint.__name__}")
    return value


def _describe(hint: Any) -> str:
    # list[int] rather than its __name__ "list", so `list[int] | list[list[int]]` reads as both
    return " or ".join(str(a) if typing.get_args(a) else getattr(a, "__name__", str(a)) for a in typing.get_args(hint))


def to_dict(config) -> dict:
    return dataclasses.asdict(config)


def dump_config(config, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_dict(config), indent=2, default=str))
