"""R3 (rollout routing replay): hand the rollout's routed experts to this rank's Megatron routers.

Owns the alignment between a batch's `routed_experts` and the routers of this rank's model
stage, the checks on it, the switching of megatron-core's RouterReplay actions around the
pipeline schedule, the train/rollout routing agreement and the expert load of natural routing.

How rows are aligned (`routed_experts` is [B, S, num_hidden_layers, topk] of any integer dtype:
the rollout ships uint8 / int16, `moe_rl.sample.routing_dtype`; `_targets` widens the rows to
int64, megatron-core's index dtype, only where they are handed to a RouterReplay):
- Tokens. Row t holds the experts token t went to during the rollout. The model's inputs are
  tokens[:, :-1], so rows 0..S-2 are replayed and row S-1 never is (SGLang sends every token
  but the last; the batch builder pads that row).
- Real rows. Row t of sample b is real when t < the last index with loss_mask[b] != 0: those
  are exactly the inputs a trained prediction depends on (causal attention). Every other row
  (padding to the batch length, the padding `pad_sequence_dim` adds for sequence parallel, a
  tail after the last trained token) may hold anything: it is replaced by experts
  0..topk-1 before replay and left out of checks and of `agreement`.
- Layers. Each TopKRouter knows its global 1-based `layer_number` (PP stage offset included),
  so it replays HF layer `layer_number - 1`; only MoE layers have routers, dense layers' rows
  are ignored.
- Router rows. A router sees this microbatch's hidden states [S_local, mb, H] flattened
  sequence-major: router row = s * mb + b. The rows are first mapped to the tokens the model runs
  (`before_forward(..., to_model)`, `moe_rl.trainer.microbatches.ModelTokens.to_model`): a packed
  micro-batch (trainer.pack_sequences) is [T, 1, H], and under context parallelism (trainer.cp)
  this rank runs chunks r and 2cp-1-r of each sequence (segment), S' tokens in all. With sequence
  parallel, TP rank r sees the contiguous chunk [r * S'/tp, (r + 1) * S'/tp) of them (the trainer
  pads the inputs to the sequence multiple, 2 x cp x tp). Expert ids are global (EP needs no mapping).

megatron-core 0.16.1 quirks handled here (docs/algorithm.md, "Routing replay (R3)"): 0.16.1 never switches to
REPLAY_BACKWARD itself, so `running("replay")` wraps the schedules' `backward_step`; activation
recompute then pops each microbatch's own indices from the per-router FIFO that
`set_target_indices` fills (forward order = 1F1B backward order). Nothing checks shapes or ids,
so `check` does. The FIFO only shrinks under recompute, so indices are cleared after every
schedule. Only this model's RouterReplay objects are driven, never through the process-global
list (which also holds the routers of every other model built in the process).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
import torch.distributed as dist

Batch = dict[str, torch.Tensor]
ToModel = Callable[[torch.Tensor], torch.Tensor]
"""[mb, S-1, ...] input-side rows -> the tokens this rank's model runs: packed [1, T, ...]
(trainer.pack_sequences), then its context-parallel chunks (trainer.cp)."""


def moe_layer_indices(config) -> list[int]:
    """Global (HF) indices of the MoE layers of a Megatron TransformerConfig."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [layer for layer in range(config.num_layers) if layer % freq == 0]
    return [layer for layer, is_moe in enumerate(freq) if is_moe]


def real_input_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """bool [B, S-1]: the inputs that some trained prediction depends on (see module doc)."""
    positions = torch.arange(loss_mask.shape[1], device=loss_mask.device)
    last = torch.where(loss_mask != 0, positions, -1).amax(dim=1)
    return positions[:-1] < last[:, None]


class RoutingReplay:
    """Drives the RouterReplay objects of one model stage (built with moe_enable_routing_replay)."""

    def __init__(self, model):
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router import TopKRouter

        config = model.config
        # MTP layers route on their own: rollouts carry the decoder layers' experts only
        routers = [m for m in model.modules() if isinstance(m, TopKRouter) and m.layer_number <= config.num_layers]
        if config.moe_router_fusion or any(router.routing_type == "sinkhorn" for router in routers):
            raise ValueError(
                "routing replay is skipped by megatron-core with moe_router_fusion=True or "
                "sinkhorn routing: turn those off or set trainer.routing_replay=false"
            )
        assert all(router.router_replay is not None for router in routers), "build with moe_enable_routing_replay"
        self.layers = [router.layer_number - 1 for router in routers]
        self.replays = [router.router_replay for router in routers]
        self.moe_layers = moe_layer_indices(config)
        self.num_layers = config.num_layers
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        # sequence parallel splits each microbatch's tokens over the TP ranks: this rank routes
        # chunk sp_index of sp_split
        self.sp_split = parallel_state.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1
        self.sp_index = parallel_state.get_tensor_model_parallel_rank() if config.sequence_parallel else 0
        self._mode: str | None = None  # "replay" | "record" while a schedule runs
        self._tally: dict[int, list[float]] = {}
        self._load: dict[int, torch.Tensor] = {}  # HF layer -> recorded slots per expert, real rows

    # -- checks (every rank, same whole batch, before any forward) ----------------------------
    def check(self, batch: Batch) -> None:
        if "routed_experts" not in batch:
            raise ValueError(
                "batch lacks 'routed_experts' [B, S, num_hidden_layers, topk]: request "
                "return_routed_experts from the engine, or run without routing replay"
            )
        routed = batch["routed_experts"]
        rows, seq = batch["tokens"].shape
        expected = (rows, seq, self.num_layers, self.topk)
        if routed.dtype.is_floating_point or routed.dtype == torch.bool or tuple(routed.shape) != expected:
            raise ValueError(
                f"batch['routed_experts'] is {routed.dtype} {tuple(routed.shape)}; expected an "
                f"integer tensor {expected} (B, S, num_hidden_layers, topk)"
            )
        real = real_input_rows(batch["loss_mask"])
        ids = routed[:, :-1][:, :, self.moe_layers][real].long()  # [real rows, MoE layers, topk]
        bad = (ids < 0) | (ids >= self.num_experts)
        if bad.any():
            where = bad.nonzero()[0].tolist()
            raise ValueError(
                f"batch['routed_experts'] holds expert id {ids[tuple(where)].item()} outside "
                f"[0, {self.num_experts}) at a real token (MoE layer {self.moe_layers[where[1]]}): "
                f"pass global expert ids of this model"
            )
        ordered = ids.sort(dim=-1).values
        if (ordered[..., 1:] == ordered[..., :-1]).any():
            raise ValueError(
                "batch['routed_experts'] names an expert twice in one token's top-k at a real "
                "token: each row must hold topk distinct expert ids"
            )

    # -- what this rank's routers see ---------------------------------------------------------
    def _local_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """[mb, S', ...] -> [S_local * mb, ...] in router row order (s * mb + b, SP chunk)."""
        chunk = tensor.shape[1] // self.sp_split
        local = tensor.transpose(0, 1)[self.sp_index * chunk : (self.sp_index + 1) * chunk]
        return local.reshape(-1, *tensor.shape[2:])

    def _targets(self, microbatch: Batch, to_model: ToModel | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [rows, local MoE layers, topk] with non-real rows filled, real [rows])."""
        real = real_input_rows(microbatch["loss_mask"])
        ids = microbatch["routed_experts"][:, :-1][:, :, self.layers].long()
        if to_model is not None:  # packed and/or this rank's CP chunks, in the model's token order
            ids, real = to_model(ids), to_model(real)
        filler = torch.arange(self.topk, device=ids.device)
        ids = torch.where(real[..., None, None], ids, filler)
        return self._local_rows(ids), self._local_rows(real)

    # -- schedule hooks ---------------------------------------------------------------------
    def before_forward(self, microbatch: Batch, to_model: ToModel | None = None) -> None:
        """Queue this microbatch's routing (forward target + recompute FIFO) when replaying.
        `to_model`: maps input-side [mb, S-1, ...] tensors to the tokens the model runs (packed,
        CP chunks; `moe_rl.trainer.microbatches.ModelTokens.to_model`)."""
        if self._mode == "replay":
            ids, _ = self._targets(microbatch, to_model)
            for index, replay in enumerate(self.replays):
                replay.set_target_indices(ids[:, index].contiguous())

    def after_forward(self, microbatch: Batch, to_model: ToModel | None = None) -> None:
        """Tally recorded vs given top-k sets, and the recorded slots per expert, when recording
        (recorded data is per forward)."""
        if self._mode != "record":
            return
        ids, real = self._targets(microbatch, to_model)
        for index, (layer, replay) in enumerate(zip(self.layers, self.replays)):
            recorded = replay.get_recorded_indices()
            hits = (recorded[:, :, None] == ids[:, None, index]).any(-1).sum(-1)
            tally = self._tally.setdefault(layer, [0.0, 0.0])
            tally[0] += float((hits * real).sum())
            tally[1] += float(real.sum()) * self.topk
            counts = torch.bincount(recorded[real].flatten().cpu(), minlength=self.num_experts)
            self._load[layer] = self._load.get(layer, 0) + counts

    def _set_action(self, action) -> None:
        for replay in self.replays:
            replay.set_router_replay_action(action)

    def _reset(self) -> None:
        self._mode = None
        for replay in self.replays:
            replay.clear_indices()
            replay.clear_router_replay_action()

    @contextmanager
    def running(self, mode: str):
        """Around one schedule. "replay": replay the queued routing in forwards and, inside each
        backward step, in activation recompute. "record": natural routing, recorded per forward
        and tallied against the batch's routing for `agreement`."""
        # heavy: megatron-core, loaded only where a model is built (after parallel.cpu_compat.apply)
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        assert mode in ("replay", "record"), mode
        original = schedules.backward_step

        def backward_step(*args, **kwargs):
            self._set_action(RouterReplayAction.REPLAY_BACKWARD)
            try:
                return original(*args, **kwargs)
            finally:
                self._set_action(RouterReplayAction.REPLAY_FORWARD)

        self._mode = mode
        if mode == "replay":
            self._set_action(RouterReplayAction.REPLAY_FORWARD)
            schedules.backward_step = backward_step
        else:
            self._tally, self._load = {}, {}
            self._set_action(RouterReplayAction.RECORD)
        try:
            yield
        finally:
            schedules.backward_step = original
            self._reset()

    def agreement(self) -> dict[int, float]:
        """{HF layer index: mean |trainer top-k ∩ rollout top-k| / topk over real tokens} for every
        MoE layer of the model, from the last `running("record")`. Collective: every rank of the default
        world calls it and gets the whole dict (PP stages own different layers, SP, CP and DP
        ranks different tokens; TP ranks without SP count the same tokens, which the ratio cancels).
        """
        gathered: list[dict[int, list[float]]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, self._tally)
        totals: dict[int, list[float]] = {}
        for part in gathered:
            for layer, (hits, count) in part.items():
                total = totals.setdefault(layer, [0.0, 0.0])
                total[0] += hits
                total[1] += count
        return {layer: hits / count if count else float("nan") for layer, (hits, count) in sorted(totals.items())}

    def load(self) -> dict[int, torch.Tensor]:
        """{HF layer index: int64 [num_experts] routed slots per expert over real tokens} for every MoE
        layer of the model, from the last `running("record")` (its natural routing). Collective, as
        `agreement`; TP ranks without sequence parallel count the same tokens, so the counts are then
        tp times the tokens', the shares (`moe_rl.rollout.expert_load`) exact."""
        gathered: list[dict[int, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, self._load)
        totals: dict[int, torch.Tensor] = {}
        for part in gathered:
            for layer, counts in part.items():
                totals[layer] = totals.get(layer, 0) + counts
        return dict(sorted(totals.items()))
