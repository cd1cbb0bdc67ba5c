"""One rank of the Megatron trainer: model stage + DDP + Megatron optimizer + train steps.

Every rank of the trainer world constructs a `MegatronTrainer` and calls each method in
lockstep (they run collectives). The same code runs on gloo/CPU (after `cpu_compat`) and on
NCCL/GPUs. Losses are summed per token and normalised by the number of loss tokens of the
whole global batch (Megatron's `calculate_per_token_loss`), so the loss and the gradients do
not depend on the layout. With `routing_replay`, batches carrying `routed_experts` are routed as
the rollout routed them (R3, see moe_rl.trainer.routing_replay). `build_reference` adds a frozen
copy of the initial policy on the same ranks for the KL term (moe_rl.trainer.reference).
trainer.moe sets how the routers train (frozen, the expert-bias update, the load-balancing loss;
parallel.router); with the latter two the routers count real tokens only (a padding mask).
With trainer.max_tokens_per_microbatch, micro-batches are cut by a token budget and balanced over
DP ranks (moe_rl.trainer.microbatches); per-row outputs come back in the batch's order. With
trainer.pack_sequences each one runs packed (THD, `PackedSeqParams`; Transformer Engine attention):
the model sees [1, T] and the logprobs are unpacked into the micro-batch's rows before the loss;
MTP layers shift their inputs and labels within each row of the packed sequence.
With trainer.precision "bf16" the model computes in bf16 (megatron-core's Float16Module, logits
back in fp32) while DDP accumulates and reduces gradients in fp32 and the optimizer steps fp32 main
parameters, copying them back to the bf16 ones after each step (Megatron-LM's mixed precision);
weights loaded after the optimizer is built are copied into its main parameters.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist

from moe_rl.config import TrainerConfig
from moe_rl.conversion.directory import is_converted, load_model_weights
from moe_rl.trace import TRACER
from moe_rl.trainer.logprobs import token_entropy, token_logprobs
from moe_rl.trainer.microbatches import (
    Batch,
    Microbatch,
    ModelTokens,
    budget_microbatches,
    check_batch,
    pack_microbatch,
    pad_sequence_dim,
    row_microbatches,
    split_rows,
)
from moe_rl.trainer.reference import FrozenModel, build_reference
from moe_rl.trainer.routing_replay import RoutingReplay, real_input_rows
from parallel.bridges import bridge_for
from parallel.context import uses_transformer_engine
from parallel.export import export_hf_weights, save_hf_checkpoint
from parallel.fp8 import BlockFP8
from parallel.lora import LoRAConfig, adapters_disabled, add_lora
from parallel.mappings import OwnerDiffs
from parallel.model import (
    build_gpt_model,
    forward,
    init_model_parallel,
    precision_config,
    unwrap,
    use_transformer_engine,
    with_precision,
)
from parallel.peft import collect_adapter, load_adapter, save_adapter

LossFn = Callable[[torch.Tensor, Batch], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]
"""(logprobs [mb, L], microbatch) -> (loss summed over tokens, number of tokens, sums to report).
`microbatch` tensors are aligned with logprobs: column t is the prediction of token t + 1."""


def next_token_loss(logprobs: torch.Tensor, microbatch: Batch):
    """Supervised cross-entropy over the tokens selected by `loss_mask`."""
    mask = microbatch["loss_mask"].float()
    loss = -(logprobs * mask).sum()
    return loss, mask.sum().to(torch.int), {"loss": loss.detach()}


def _expert_params_own_optimizer(model) -> None:
    """Give expert weights their own grad buffers and optimizer at EP=1 too.

    Megatron marks expert params `allreduce=False` only when EP > 1, so at EP=1 they join the
    dense optimizer and a checkpoint's optimizer structure (one vs two chained optimizers)
    depends on the layout: an EP2 checkpoint could not load at EP1. At EP=1 the expert
    data-parallel group equals the dense one, so reducing them separately changes nothing.
    """
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core.transformer.moe.experts import SequentialMLP

    for module in model.modules():
        if isinstance(module, SequentialMLP):
            for param in module.parameters():
                param.allreduce = False


def _check_packable(model, which: str) -> None:
    """trainer.pack_sequences needs attention that runs THD: Transformer Engine's. MTP layers follow
    the packing (megatron-core rolls their inputs, labels and loss mask within each cu_seqlens
    segment, never across a row boundary); MLA runs THD through TE's attention too."""
    if not uses_transformer_engine(model):
        raise ValueError(
            f"trainer.pack_sequences=true, but {which} was built with megatron-core's local spec, whose "
            "attention cannot run packed (THD) sequences: it needs the Transformer Engine spec (GPUs with "
            "transformer_engine installed). Set trainer.pack_sequences=false: the token-budget "
            "micro-batches still apply"
        )


def _keep_logprobs(logprobs: torch.Tensor, microbatch: Batch):
    """A forward-only "loss" that hands the logprobs back through the schedule."""
    # on the logprobs' device: the schedule scales this "loss" by a loss scale on the model's device
    zero = logprobs.new_zeros(())
    return zero, zero.to(torch.int), {"logprobs": logprobs.detach()}


def _with_logprobs(loss_fn: LossFn, logprobs: torch.Tensor, microbatch: Batch):
    """`loss_fn`, its report carrying the logprobs it was given (detached) back as well."""
    loss_sum, num_tokens, report = loss_fn(logprobs, microbatch)
    return loss_sum, num_tokens, {**report, "logprobs": logprobs.detach()}


def _taken_mtp_losses(microbatches: int, context_parallel: bool = False) -> list[dict]:
    """The MTP losses megatron-core logged for this rank's training micro-batches, `microbatches`
    of them with rows, as one more report (none without MTP), its tracker then zeroed. The tracker
    holds, per MTP layer, the sum over micro-batches of each one's token-mean cross entropy. Under
    context parallelism each CP rank logs the mean over its own chunks (0/0 on 0.16, 0 on 0.19 for
    a chunk without trained tokens), from which the micro-batch's mean cannot be recovered: no
    report then (the MTP gradients are exact)."""
    # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    # megatron-core <= 0.18 keeps the losses under "values"; 0.19 under "loss_values", beside
    # acceptance counts, cleaned by clean_metrics_in_tracker
    tracker = MTPLossLoggingHelper.tracker
    values = tracker.get("loss_values", tracker.get("values"))
    if values is None:
        return []
    clean = (
        getattr(MTPLossLoggingHelper, "clean_metrics_in_tracker", None) or MTPLossLoggingHelper.clean_loss_in_tracker
    )
    finite = bool(torch.isfinite(values).all()) and not context_parallel
    taken = {"mtp_loss": float(values.mean()), "mtp_microbatches": float(microbatches)}
    clean()
    # a token-budget padding micro-batch (no loss tokens) logs 0 on 0.19, so it is not counted, and
    # 0/0 on <= 0.18: this rank then reports no mtp_loss (gradients are unaffected either way: the
    # loss itself is a per-token sum)
    return [taken] if finite else []


@dataclass
class StepResult:
    """What one optimizer step reports; identical on every rank."""

    step: int
    loss: float
    """Token-mean of the loss over the global batch."""
    grad_norm: float
    """Global grad norm before clipping (over all ranks and all parameters)."""
    num_tokens: int
    skipped: bool
    sums: dict[str, float]
    """Every quantity the loss function reported, summed over the global batch."""
    mtp_loss: float | None = None
    """Mean cross entropy of the MTP layers (megatron-core's own: per microbatch over its loss
    mask, then averaged over layers, microbatches and DP ranks); None without MTP layers."""
    logprobs: torch.Tensor | None = None
    """[B, S-1] the logprobs of the step's forward, before its update (`keep_logprobs`)."""


class MegatronTrainer:
    def __init__(self, config: TrainerConfig, hf_config: Any, lora: LoRAConfig | None = None):
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config.check_packing_precision(gpu_te=use_transformer_engine())
        config.check_context_parallel_precision(gpu_te=use_transformer_engine())
        self.config = config
        self.bridge = bridge_for(hf_config)
        config.moe.check_model(self.bridge)
        init_model_parallel(config, config.seed)
        # where build_gpt_model puts the model: batches arrive on the host and move per micro-batch
        # (`Microbatch.to`, in `_run_schedule`)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        recompute = (
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
            if config.recompute
            else {}
        )
        replay = dict(moe_enable_routing_replay=True) if config.routing_replay else {}
        # token-budget micro-batches differ in length: pipeline p2p sends each one's shape first
        variable = dict(variable_seq_lengths=True) if config.max_tokens_per_microbatch is not None else {}
        # trainer.moe: frozen routers get no grad before DDP and the optimizer see them (parallel.router)
        router = config.moe.router()
        # the bias update and the load-balancing loss count the real tokens only (not padding, nor
        # the experts R3 fills padding rows with): the forward then gets a padding mask
        self._mask_padding = router.counts_tokens
        # LoRA adapts both specs (parallel.lora): the TE spec where TE is installed, as without LoRA
        model = build_gpt_model(
            self.bridge,
            config,
            router=router,
            calculate_per_token_loss=True,
            mtp_loss_scaling_factor=config.mtp_loss_weight,
            **precision_config(config.precision),
            **recompute,
            **replay,
            **variable,
        )
        if config.mtp_loss_weight == 0 and hasattr(model, "mtp"):  # carried along: no grads, no Adam state
            model.mtp.requires_grad_(False)
        self.lora = lora
        if lora is not None:  # freezes the base: DDP, the optimizer and checkpoints see only adapters
            add_lora(model, self.bridge, lora, config.seed)
        if config.pack_sequences:
            _check_packable(model, "the policy")
        _expert_params_own_optimizer(model)
        self.routing = RoutingReplay(model) if config.routing_replay else None
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,  # bf16 too: main_grad buffers accumulate and all-reduce in fp32
            use_distributed_optimizer=config.optimizer.distributed,
            average_in_collective=False,  # per-token loss: grads are summed, then / num_tokens
        )
        self.model = DistributedDataParallel(model.config, ddp_config, with_precision(model))
        opt = config.optimizer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.adam_beta1,
                adam_beta2=opt.adam_beta2,
                adam_eps=opt.adam_eps,
                clip_grad=opt.clip_grad,
                use_distributed_optimizer=opt.distributed,
                bf16=model.config.bf16,  # fp32 main params (and Adam state) beside the bf16 model's
                params_dtype=model.config.params_dtype,
            ),
            [self.model],
        )
        # What Megatron-LM's training loop wires into the model config for the schedules.
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.grad_scale_func = self.optimizer.scale_loss
        model.config.no_sync_func = self.model.no_sync
        self.step = 0
        self.reference: FrozenModel | None = None

    # -- ranks --------------------------------------------------------------------------------
    @property
    def is_last_stage(self) -> bool:
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core import parallel_state

        return parallel_state.is_pipeline_last_stage()

    def dp_rank_and_size(self) -> tuple[int, int]:
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    @property
    def gpt_model(self):
        """This rank's GPTModel stage, without its DDP (and, in bf16, Float16Module) wrappers: what
        the bridges' tables name and what exports, imports and checkpoints read."""
        return unwrap(self.model)

    # -- weights ------------------------------------------------------------------------------
    def load_hf_weights(self, hf_dir: str) -> None:
        """Fill this rank's shards from an HF safetensors directory, or a checkpoint `moe-rl convert
        hf-to-megatron` wrote, at any layout (collective; `moe_rl.conversion.directory`)."""
        if self.lora is not None and is_converted(hf_dir):
            raise ValueError(
                f"model.path={hf_dir!r} is a converted checkpoint; with lora the base loads from the HF "
                "model for now: point model.path at it"
            )
        load_model_weights(self.gpt_model, self.bridge, hf_dir)
        self.optimizer.reload_model_params()  # bf16: the fp32 main params were copied at build

    def export_hf_weights(self, bucket_bytes: int, fp8: BlockFP8 | None = None, owner: OwnerDiffs | None = None):
        """`(hf_name, tensor)` stream of the current weights on each stage's source rank, FP8 blocks
        quantized where each weight lives (`fp8`), each tensor diffed by its owner (`owner`, with
        `sync.delta`: experts before the EP gather, the rest on their TP diff owners). Collective:
        every rank iterates it to the end (see parallel.export)."""
        return export_hf_weights(self.gpt_model, self.bridge, bucket_bytes=bucket_bytes, fp8=fp8, owner=owner)

    def export_adapter(self) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """(PEFT adapter_config, {PEFT name: tensor}) of the adapters on global rank 0, None on the
        other ranks (collective; see parallel.peft)."""
        return collect_adapter(self.gpt_model, self.bridge, self._require_lora("export_adapter"))

    def save_adapter(self, out_dir: str, base_model: str | None = None) -> None:
        """Write the adapters as a PEFT adapter directory (collective)."""
        save_adapter(self.gpt_model, self.bridge, self._require_lora("save_adapter"), out_dir, base_model)

    def load_adapter(self, adapter_dir: str) -> None:
        """Fill the adapters from a PEFT adapter directory (collective)."""
        self._require_lora("load_adapter")
        load_adapter(self.gpt_model, self.bridge, adapter_dir)
        self.optimizer.reload_model_params()

    def _require_lora(self, what: str) -> LoRAConfig:
        if self.lora is None:
            raise ValueError(f"{what} needs adapters: set the lora: section")
        return self.lora

    def save_hf_checkpoint(self, out_dir: str, hf_config: dict, merged: bool = True, fp8=None) -> None:
        """Write the current weights as an HF checkpoint the engines can serve (collective); with
        LoRA the adapters are merged in (base + scale * B A) unless `merged=False` (the frozen base).
        `fp8` (a parallel.fp8.BlockFP8): linear weights as FP8 blocks."""
        save_hf_checkpoint(self.gpt_model, self.bridge, out_dir, hf_config, merge_adapters=merged, fp8=fp8)

    # -- training -----------------------------------------------------------------------------
    def train_step(
        self,
        batch: Batch,
        loss_fn: LossFn = next_token_loss,
        mini_batches: int = 1,
        keep_logprobs: bool = False,
        before_update: Callable[[], None] | None = None,
    ) -> StepResult:
        """Optimizer steps on a global batch (every rank passes the same whole batch): one, or one
        per block of rows with `mini_batches` (PPO mini-batches), each normalised by its own
        tokens. The result sums the blocks' reports; `grad_norm` is their mean. The batch holds
        trainer.global_batch_size sequences, or more in whole multiples of the mini-batches'
        microbatches (agent episodes forked by history edits add rows; see rollout.train_batch).
        `keep_logprobs` (one mini-batch): the result also holds the forward's logprobs, gathered
        like `forward_logprobs` gives them (the RL step's old logprobs, without a pass of their own).
        `before_update`: called once after the first block's backward, before its optimizer step,
        on the weights the step began with (the consistency probe's compare runs there, so that
        the engines' scoring it waits for has the forward-backward's time to arrive)."""
        rows = self._check_rows(batch, mini_batches)
        if keep_logprobs and mini_batches != 1:
            raise ValueError(f"train_step keep_logprobs with mini_batches={mini_batches}: it keeps one forward, use 1")
        step_loss = partial(_with_logprobs, loss_fn) if keep_logprobs else loss_fn
        sums: dict[str, float] = {}
        norms, skipped, logprobs = [], False, None
        for index in range(mini_batches):
            block = split_rows(batch, mini_batches, index)
            self.model.train()
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            with TRACER.span("forward-backward", mini_batch=index):
                reports = self._run_schedule(
                    block,
                    partial(self._forward_step, step_loss, self.routing),
                    forward_only=False,
                    routing=self._routing_mode(block, None),
                    rows=rows // mini_batches,
                )
            if keep_logprobs:
                logprobs = self._gather_rows(reports, "logprobs", batch["tokens"].shape[1] - 1)
                reports = [{key: value for key, value in report.items() if key != "logprobs"} for report in reports]
            mtp = _taken_mtp_losses(sum(1 for report in reports if report["rows"]), self.config.cp > 1)
            if before_update is not None and index == 0:  # grads are reduced; forwards leave them be
                before_update()
            with TRACER.span("optimizer", mini_batch=index):
                updated, grad_norm, _ = self.optimizer.step()
            self.step += 1
            for key, value in self._reduce_reports(reports + mtp).items():
                sums[key] = sums.get(key, 0.0) + value
            norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
            skipped |= not updated
        tokens = sums.pop("num_tokens", 0.0)
        mtp_microbatches = sums.pop("mtp_microbatches", 0.0)
        mtp_loss = sums.pop("mtp_loss") / mtp_microbatches if mtp_microbatches else None
        return StepResult(
            step=self.step,
            loss=sums.get("loss", 0.0) / max(tokens, 1.0),
            grad_norm=sum(norms) / len(norms),
            num_tokens=int(tokens),
            skipped=skipped,
            sums=sums,
            mtp_loss=mtp_loss,
            logprobs=logprobs,
        )

    @torch.no_grad()
    def forward_logprobs(self, batch: Batch, replay: bool | None = None, rows: int | None = None) -> torch.Tensor:
        """log p(tokens[:, t+1] | tokens[:, :t+1]) as [B, S-1] for the whole batch, returned on
        every rank (collective). Used for the PPO behaviour policy and the reference model.
        `replay`: route as `batch["routed_experts"]` says (True), naturally (False), or
        (None) replay when trainer.routing_replay is on and the batch carries routed experts.
        `rows`: a batch of this many sequences instead of a training batch's (a probe's few: a
        multiple of dp, each DP rank's share one micro-batch)."""
        self.model.eval()
        reports = self._run_schedule(
            batch,
            partial(self._forward_step, _keep_logprobs, self.routing),
            forward_only=True,
            routing=self._routing_mode(batch, replay),
            rows=rows,
        )
        self.model.train()
        return self._gather_rows(reports, "logprobs", batch["tokens"].shape[1] - 1)

    # -- frozen reference (KL) ----------------------------------------------------------------
    def build_reference(self, hf_dir: str | None = None) -> None:
        """Build the frozen reference on this rank: the HF checkpoint `hf_dir` if given, else the
        policy as initialised from trainer.seed (collective; see moe_rl.trainer.reference). With
        LoRA: the policy with its adapters off (`hf_dir` unused), no second model."""
        if self.lora is not None:
            self.reference = FrozenModel(self.model, self.routing, adapters_off=True)
        else:
            self.reference = build_reference(self.bridge, self.config, hf_dir)
            if self.config.pack_sequences:
                _check_packable(self.reference.model, "the reference model")

    @torch.no_grad()
    def reference_logprobs(self, batch: Batch, replay: bool | None = None) -> torch.Tensor:
        """Like `forward_logprobs`, from the frozen reference: [B, S-1] on every rank (collective).
        With R3 the reference replays `batch["routed_experts"]` through its own routers."""
        if self.reference is None:
            raise RuntimeError("reference_logprobs before build_reference: build the reference model first")
        frozen = self.reference
        frozen.model.eval()
        with adapters_disabled(frozen.model) if frozen.adapters_off else nullcontext():
            reports = self._run_schedule(
                batch,
                partial(self._forward_step, _keep_logprobs, frozen.routing),
                forward_only=True,
                routing=self._routing_mode(batch, replay, frozen.routing),
                model=frozen.model,
                replay=frozen.routing,
            )
        if frozen.adapters_off:
            frozen.model.train()  # the policy itself
        return self._gather_rows(reports, "logprobs", batch["tokens"].shape[1] - 1)

    @torch.no_grad()
    def natural_forward(self, batch: Batch, rows: int | None = None) -> tuple[torch.Tensor, dict[int, float]]:
        """One forward with natural routing that records it (collective; every rank gets both):
        the logprobs [B, S-1], as `forward_logprobs(batch, replay=False)` gives them, and {HF layer
        index: mean over real tokens of |trainer top-k ∩ batch top-k| / topk} for every MoE layer.
        `rows`: as in `forward_logprobs`."""
        self._require_routing("natural_forward")
        self.model.eval()
        reports = self._run_schedule(
            batch,
            partial(self._forward_step, _keep_logprobs, self.routing),
            forward_only=True,
            routing="record",
            rows=rows,
        )
        self.model.train()
        return self._gather_rows(reports, "logprobs", batch["tokens"].shape[1] - 1), self.routing.agreement()

    def natural_load(self) -> dict[int, torch.Tensor]:
        """{HF layer index: routed slots per expert} of the last `natural_forward`'s routing, over the
        real tokens, for every MoE layer (collective; see RoutingReplay.load)."""
        self._require_routing("natural_load")
        return self.routing.load()

    def _require_routing(self, what: str) -> None:
        if self.routing is None:
            raise ValueError(f"{what} needs routers built for replay: set trainer.routing_replay=true")

    def _routing_mode(self, batch: Batch, replay: bool | None, routing: RoutingReplay | None = None) -> str | None:
        routing = routing or self.routing
        if replay is None:
            replay = routing is not None and "routed_experts" in batch
        if replay:
            self._require_routing("routing replay")
        return "replay" if replay else None

    def _run_schedule(
        self,
        batch: Batch,
        forward_step,
        forward_only: bool,
        routing: str | None = None,
        model=None,
        replay: RoutingReplay | None = None,
        rows: int | None = None,
    ) -> list[dict]:
        """`routing`: None (natural), "replay" or "record" (see RoutingReplay). `model`, `replay`:
        the stage to run and its RoutingReplay (default: the policy's). `rows`: the batch's
        expected sequences (default trainer.global_batch_size; a mini-batch has fewer)."""
        model, replay = model or self.model, replay or self.routing
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.pipeline_parallel import get_forward_backward_func

        check_batch(batch)
        if rows is None:
            rows = self._check_rows(batch, 1)
        if batch["tokens"].shape[0] != rows:
            raise ValueError(f"batch has {batch['tokens'].shape[0]} sequences where {rows} are expected")
        if routing is not None:
            replay.check(batch)
        multiple = self.config.sequence_multiple  # 2 x cp chunks, each split over TP under SP
        batch = pad_sequence_dim(batch, multiple)
        dp_rank, dp_size = self.dp_rank_and_size()
        budget = self.config.max_tokens_per_microbatch
        if budget is None:  # a batch of fewer rows than a micro-batch per DP rank (a probe's) runs as one
            micro_batch_size = min(self.config.micro_batch_size, max(rows // dp_size, 1))
            parts = row_microbatches(batch, dp_size, dp_rank, micro_batch_size)
        else:
            parts = budget_microbatches(batch, dp_size, dp_rank, budget, multiple)
            if self.config.pack_sequences:
                parts = [pack_microbatch(part, multiple, self.config.context_chunks) for part in parts]
        # the largest micro-batch (with variable_seq_lengths p2p sends the real shapes)
        if parts[0].packing is None:
            seq_length = max(part.batch["tokens"].shape[1] for part in parts) - 1
            micro_batch_size = max(part.batch["tokens"].shape[0] for part in parts)
        else:
            seq_length, micro_batch_size = max(part.packing.total for part in parts), 1
        with nullcontext() if routing is None else replay.running(routing):
            reports = get_forward_backward_func()(
                forward_step_func=forward_step,
                # each micro-batch moves to the model's device as the schedule takes it
                data_iterator=iter(parts) if self.device is None else (part.to(self.device) for part in parts),
                model=[model],
                num_microbatches=len(parts),
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=forward_only,
            )
        # the last stage reports once per micro-batch, in order: tag each with its batch rows
        return [{**report, "rows": part.rows} for report, part in zip(reports, parts)]

    def _check_rows(self, batch: Batch, mini_batches: int) -> int:
        """The batch's sequences: trainer.global_batch_size, or more in whole multiples of the
        mini-batches' microbatches (micro_batch_size x dp)."""
        rows = batch["tokens"].shape[0]
        _, dp_size = self.dp_rank_and_size()
        unit = mini_batches * self.config.micro_batch_size * dp_size
        if rows < self.config.global_batch_size or rows % unit:
            raise ValueError(
                f"batch has {rows} sequences but trainer.global_batch_size={self.config.global_batch_size}: "
                f"give that many (or more, in multiples of {unit} = mini-batches x micro_batch_size x dp)"
            )
        return rows

    def _forward_step(self, loss_fn: LossFn, routing: RoutingReplay | None, data_iterator, model):
        part: Microbatch = next(data_iterator)
        microbatch = part.batch
        tokens = microbatch["tokens"]
        aligned = {key: tensor[:, 1:] for key, tensor in microbatch.items()}
        # the model sees [1, T] when packed and this rank's CP chunks; the loss below still sees the rows
        view = ModelTokens.of(part, self._cp_group())
        inputs, targets = view.to_model(tokens[:, :-1]), view.to_model(tokens[:, 1:])
        mask = view.to_model(aligned["loss_mask"])
        params = None if part.packing is None else part.packing.packed_seq_params()
        padding = None
        if self._mask_padding:
            real = view.to_model(real_input_rows(microbatch["loss_mask"]))
            # tokens without real ones (a padding micro-batch, or a CP rank's chunks of short rows) run
            # unmasked: megatron-core's balancing losses would divide by 0
            if real.any():
                padding = ~real
        if routing is not None:
            routing.before_forward(microbatch, view.to_model)
        output = forward(
            model,
            inputs,
            view.positions(tokens),
            labels=targets,
            loss_mask=mask,
            packed_seq_params=params,
            padding_mask=padding,
        )
        if routing is not None:
            routing.after_forward(microbatch, view.to_model)

        def loss(logits):
            # per-row losses (seq-mean, GSPO, MIS) read whole rows: under CP every rank gathers them
            # and computes the same loss, keeping its own tokens' gradient
            logprobs = view.to_rows(token_logprobs(logits, targets, self.bridge.vocab_size))
            entropy = view.to_rows(token_entropy(logits, self.bridge.vocab_size).detach())
            loss_sum, num_tokens, report = loss_fn(logprobs, aligned)
            # entropy summed over trained tokens
            report = {**report, "entropy": (entropy * aligned["loss_mask"]).sum()}
            if not part.rows:  # a padding micro-batch: it runs (collectives stay in lockstep), weighs nothing
                loss_sum, num_tokens = loss_sum * 0, torch.zeros_like(num_tokens)
                report = {key: torch.zeros_like(value) for key, value in report.items()}
            if self._cp_rank() != 0:  # counted once: megatron sums the normaliser over DP x CP
                num_tokens = torch.zeros_like(num_tokens)
            return loss_sum, num_tokens, {**report, "num_tokens": num_tokens.detach()}

        return output, loss

    def _cp_group(self):
        """The context-parallel group when trainer.cp > 1, else None."""
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group() if self.config.cp > 1 else None

    def _cp_rank(self) -> int:
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_rank()

    def _reports_here(self) -> bool:
        """Whether this rank's micro-batch reports count: the last stage's first TP and CP rank (the
        others hold the same whole rows)."""
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core import parallel_state

        return self.is_last_stage and parallel_state.get_tensor_model_parallel_rank() == 0 and self._cp_rank() == 0

    def _gather_rows(self, reports: list[dict], key: str, columns: int) -> torch.Tensor:
        """Reassemble per-row tensors [rows, width] that the last stage's TP0 (CP0) ranks reported per
        micro-batch (tagged with their batch rows by `_run_schedule`) into the whole batch
        [B, columns], rows in the batch's order, on every rank. Columns past a micro-batch's width
        (token-budget micro-batches stop at their longest row) are 0: they only predict padding;
        packed micro-batches give 0 past each row's length too."""
        mine = []
        if self._reports_here():
            mine = [(r["rows"], r[key][:, :columns].cpu()) for r in reports if r["rows"]]  # host, as batches are
        shards: list = [None] * dist.get_world_size()
        dist.all_gather_object(shards, mine)
        parts = [part for shard in shards for part in shard]
        rows = sum(len(part_rows) for part_rows, _ in parts)
        out = parts[0][1].new_zeros((rows, columns))
        for part_rows, values in parts:
            out[torch.tensor(part_rows), : values.shape[1]] = values
        return out

    def _reduce_reports(self, reports: list[dict]) -> dict[str, float]:
        """Sum what the last stage's microbatches reported over DP; every rank gets the sums."""
        local: dict[str, float] = {}
        if self._reports_here():
            for report in reports:
                for key, value in report.items():
                    if key != "rows":
                        local[key] = local.get(key, 0.0) + float(value)
        gathered: list[dict[str, float]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, local)
        sums: dict[str, float] = {}
        for part in gathered:
            for key, value in part.items():
                sums[key] = sums.get(key, 0.0) + value
        return sums
