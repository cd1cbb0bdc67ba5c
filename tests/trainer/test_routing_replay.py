"""R3 routing replay in the Megatron trainer, on one 4-rank gloo world (TP2xEP2+SP, PP2xEP2).

(a) replayed routing maps equal the given routing exactly, even for a routing no router would
    pick, with padded/garbage rows in the batch; (b) against a "rollout" model whose router
    weights are perturbed, replay shrinks the logprob gap; (c) replay + activation recompute
    gives the same step as replay without recompute under PP2 1F1B with 4 microbatches per
    rank (each recompute must pop its own microbatch's routing); (d) bad `routed_experts`
    raise ValueError before any forward; (e) the expert load of natural routing counts every real
    token once over the ranks.
"""

import copy

import pytest
import torch
from tiny_qwen3 import TINY_QWEN3_MOE, hf_config

from parallel.world import spawn

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

NUM_EXPERTS, TOPK, LAYERS = TINY_QWEN3_MOE["num_experts"], TINY_QWEN3_MOE["num_experts_per_tok"], 4
ROWS, SEQ = 8, 16  # S - 1 = 15 inputs: padded to 16 under TP2 sequence parallel
PADDED_ROW, PADDED_FROM = 1, 11  # sample 1 ends at token 10: later rows are padding


def make_batch():
    """Tokens, loss mask with a padded sample, and an unnatural routing (a fixed pattern over
    sample, token and layer) with garbage in every row that must be ignored."""
    tokens = torch.randint(0, 256, (ROWS, SEQ), generator=torch.Generator().manual_seed(3))
    loss_mask = torch.ones_like(tokens)
    loss_mask[:, 0] = 0
    loss_mask[PADDED_ROW, PADDED_FROM:] = 0
    tokens[PADDED_ROW, PADDED_FROM:] = 0
    b, t, layer = torch.meshgrid(torch.arange(ROWS), torch.arange(SEQ), torch.arange(LAYERS), indexing="ij")
    first = (3 * b + 5 * t + layer) % NUM_EXPERTS
    second = (first + 1 + (b + t) % (NUM_EXPERTS - 1)) % NUM_EXPERTS
    routed = torch.stack([first, second], dim=-1).to(torch.int32)
    routed[:, -1] = -1  # the last token has no routing (SGLang sends S - 1 rows)
    routed[PADDED_ROW, PADDED_FROM - 1 :] = 99  # padding: anything
    real = torch.ones(ROWS, SEQ - 1, dtype=torch.bool)
    real[PADDED_ROW, PADDED_FROM - 1 :] = False  # input 10 only predicts a padded token
    return {"tokens": tokens, "loss_mask": loss_mask, "routed_experts": routed}, real


def capture_routing(model):
    """Every routing_map [tokens, experts] each TopKRouter dispatched with, per HF layer."""
    from megatron.core.transformer.moe.router import TopKRouter

    maps = {}
    for module in model.modules():
        if isinstance(module, TopKRouter):
            calls = maps.setdefault(module.layer_number - 1, [])
            module.register_forward_hook(lambda mod, inputs, out, calls=calls: calls.append(out[1].clone()))
    return maps


def routed_rows(trainer, maps, real):
    """(layer, routing map, rows of it that are real inputs) for every router call in `maps`, laid out
    as Megatron feeds routers (this DP rank's rows, microbatch by microbatch, sequence-major, this TP
    rank's SP chunk), and the given routing of those rows' `routed_experts` as a [rows, topk] slice."""
    from megatron.core import parallel_state

    config = trainer.config
    tp = config.tp if config.sequence_parallel else 1
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if config.sequence_parallel else 0
    inputs = -(-(SEQ - 1) // tp) * tp
    real = torch.nn.functional.pad(real, (0, inputs - SEQ + 1))
    dp_rank, dp_size = trainer.dp_rank_and_size()
    mb, per_rank = config.micro_batch_size, ROWS // dp_size
    for layer, calls in maps.items():
        assert len(calls) == per_rank // mb
        for index, routing_map in enumerate(calls):
            rows = slice(dp_rank * per_rank + index * mb, dp_rank * per_rank + (index + 1) * mb)
            chunk = slice(tp_rank * inputs // tp, (tp_rank + 1) * inputs // tp)
            keep = real[rows].transpose(0, 1)[chunk].reshape(-1)

            def given(routed, rows=rows, chunk=chunk, layer=layer):
                padded = torch.nn.functional.pad(routed[:, :-1].long(), (0, 0, 0, 0, 0, inputs - SEQ + 1))
                return padded[rows, :, layer].transpose(0, 1)[chunk].reshape(-1, TOPK)

            yield layer, routing_map, keep, given


def replay_mismatches(trainer, batch, real) -> tuple[int, int, bool]:
    """Forward with replay; compare each router's routing map with the given routing at real
    tokens (`routed_rows`). Returns (mismatched rows, checked rows, every row routed to exactly
    topk experts)."""
    maps = capture_routing(trainer.model.module)
    trainer.forward_logprobs(batch, replay=True)
    mismatched = checked = 0
    exact_topk = True
    for _, routing_map, keep, given in routed_rows(trainer, maps, real):
        ids = given(batch["routed_experts"])
        expected = torch.zeros_like(routing_map).scatter_(1, ids.clamp(0, NUM_EXPERTS - 1), True)
        mismatched += int((routing_map != expected).any(-1)[keep].sum())
        checked += int(keep.sum())
        exact_topk &= bool((routing_map.sum(-1) == TOPK).all())
    return mismatched, checked, exact_topk


def natural_load(trainer, batch, real) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """The routing-off forward: (this rank's routers' natural routing counted per expert over its
    real rows, from the routing maps they dispatched with; `natural_load` of the whole world)."""
    maps = capture_routing(trainer.model.module)
    trainer.natural_forward(batch)
    local: dict[int, torch.Tensor] = {}
    for layer, routing_map, keep, _ in routed_rows(trainer, maps, real):
        local[layer] = local.get(layer, 0) + routing_map[keep].sum(0)
    return {k: v.tolist() for k, v in local.items()}, {k: v.tolist() for k, v in trainer.natural_load().items()}


def bad_input_errors(trainer, batch) -> list[str]:
    """Messages of the ValueErrors raised for bad routing, and the router calls they let through."""
    maps = capture_routing(trainer.model.module)
    wrong_shape = {**batch, "routed_experts": batch["routed_experts"][:, :, :3]}
    out_of_range = {**batch, "routed_experts": batch["routed_experts"].clone()}
    out_of_range["routed_experts"][0, 3, 2, 0] = NUM_EXPERTS
    duplicate = {**batch, "routed_experts": batch["routed_experts"].clone()}
    duplicate["routed_experts"][2, 5, 1] = 1
    missing = {key: value for key, value in batch.items() if key != "routed_experts"}
    messages = []
    for bad in (wrong_shape, out_of_range, duplicate, missing):
        try:
            trainer.forward_logprobs(bad, replay=True)
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    try:
        trainer.train_step(duplicate)
        messages.append("no error")
    except ValueError as error:
        messages.append(str(error))
    return messages + [f"router calls: {sum(len(calls) for calls in maps.values())}"]


def run_world(hf_dir, batch, real, rollout_routing):
    from moe_rl.config import TrainerConfig
    from moe_rl.trainer.megatron_trainer import MegatronTrainer

    out = {}
    config = TrainerConfig(
        world_size=4,
        tp=2,
        ep=2,
        sequence_parallel=True,
        routing_replay=True,
        micro_batch_size=2,
        global_batch_size=ROWS,
    )
    trainer = MegatronTrainer(config, hf_config())
    trainer.load_hf_weights(hf_dir)
    out["errors"] = bad_input_errors(trainer, batch)
    rollout_batch = {**batch, "routed_experts": rollout_routing}
    out["natural_forward_logprobs"], out["rollout_agreement"] = trainer.natural_forward(rollout_batch)
    out["logprobs_replay"] = trainer.forward_logprobs(rollout_batch, replay=True)
    narrow = {**rollout_batch, "routed_experts": rollout_routing.to(torch.uint8)}  # as the rollout ships it
    out["logprobs_replay_uint8"] = trainer.forward_logprobs(narrow, replay=True)
    out["logprobs_natural"] = trainer.forward_logprobs(rollout_batch, replay=False)
    out["logprobs_default"] = trainer.forward_logprobs(rollout_batch)
    out["tp_sp"] = replay_mismatches(trainer, batch, real)
    out["tp_sp_natural_agreement"] = trainer.natural_forward(batch)[1]
    out["tp_sp_natural_load"] = natural_load(trainer, batch, real)

    steps = []
    for recompute in (False, True):
        config = TrainerConfig(
            world_size=4,
            pp=2,
            ep=2,
            routing_replay=True,
            recompute=recompute,
            micro_batch_size=1,
            global_batch_size=ROWS,
        )
        trainer = MegatronTrainer(config, hf_config())
        trainer.load_hf_weights(hf_dir)
        if not recompute:
            out["pp"] = replay_mismatches(trainer, batch, real)
            out["pp_natural_agreement"] = trainer.natural_forward(batch)[1]
            out["pp_natural_load"] = natural_load(trainer, batch, real)
            out["pp_logprobs_replay"] = trainer.forward_logprobs(rollout_batch, replay=True)
        result = trainer.train_step(batch)
        steps.append((result.loss, result.grad_norm, [p.detach().clone() for p in trainer.model.module.parameters()]))
    (loss_a, norm_a, params_a), (loss_b, norm_b, params_b) = steps
    out["recompute"] = (loss_a, loss_b, norm_a, norm_b, all(torch.equal(a, b) for a, b in zip(params_a, params_b)))
    return out


def rollout_model_outputs(reference, tokens):
    """A rollout engine's view: the same weights with perturbed routers -> (routing [B, S, L, k]
    as the top-k of each layer's router logits, logprobs [B, S-1])."""
    rollout = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in rollout.model.layers:
            layer.mlp.gate.weight.add_(0.01 * torch.randn(layer.mlp.gate.weight.shape, generator=generator))
        output = rollout(tokens, output_router_logits=True)
    routing = torch.stack(
        [logits.view(*tokens.shape, -1).topk(TOPK, dim=-1).indices for logits in output.router_logits], dim=2
    ).to(torch.int32)
    logprobs = torch.log_softmax(output.logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
    return routing, logprobs


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf_dir = tmp_path_factory.mktemp("tiny_qwen3")
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(hf_config(), dtype=torch.float32).eval()
    reference.save_pretrained(hf_dir)
    batch, real = make_batch()
    rollout_routing, rollout_logprobs = rollout_model_outputs(reference, batch["tokens"])
    rollout_routing[PADDED_ROW, PADDED_FROM - 1 :] = 99
    per_rank = spawn(run_world, 4, str(hf_dir), batch, real, rollout_routing)
    return per_rank, batch, real, rollout_logprobs


def test_replayed_routing_equals_given(world):
    per_rank, *_ = world
    for rank, out in enumerate(per_rank):
        for layout in ("tp_sp", "pp"):
            mismatched, checked, exact_topk = out[layout]
            assert checked > 0 and mismatched == 0, (rank, layout, mismatched, checked)
            assert exact_topk, (rank, layout)
            natural = out[f"{layout}_natural_agreement"]
            assert sorted(natural) == list(range(LAYERS)) and min(natural.values()) < 0.9, natural


def test_natural_load_counts_every_real_token_once(world):
    """`natural_load` gathers each rank's natural routing over real rows: the sum over ranks of what
    their routers dispatched (SP chunks, DP rows and PP stages each count their own)."""
    per_rank, _, real, _ = world
    for layout in ("tp_sp", "pp"):
        gathered = per_rank[0][f"{layout}_natural_load"][1]
        assert all(out[f"{layout}_natural_load"][1] == gathered for out in per_rank)
        expected: dict[int, list[int]] = {}
        for out in per_rank:
            for layer, counts in out[f"{layout}_natural_load"][0].items():
                expected[layer] = [a + b for a, b in zip(expected.get(layer, [0] * NUM_EXPERTS), counts)]
        assert gathered == expected and sorted(gathered) == list(range(LAYERS)), layout
        assert all(sum(counts) == int(real.sum()) * TOPK for counts in gathered.values()), layout


def test_replay_shrinks_logprob_gap(world):
    per_rank, batch, _, rollout_logprobs = world
    trained = batch["loss_mask"][:, 1:].bool()
    out = per_rank[0]
    agreement = out["rollout_agreement"]
    assert all(out["rollout_agreement"] == other["rollout_agreement"] for other in per_rank)
    assert sorted(agreement) == list(range(LAYERS)) and min(agreement.values()) < 1.0, agreement
    gap_replay = (out["logprobs_replay"] - rollout_logprobs)[trained].abs().mean()
    gap_natural = (out["logprobs_natural"] - rollout_logprobs)[trained].abs().mean()
    print(f"agreement {agreement}; |logprob gap| replay {gap_replay:.2e} vs natural {gap_natural:.2e}")
    assert gap_replay < 0.5 * gap_natural, (gap_replay, gap_natural)
    assert torch.equal(out["logprobs_default"], out["logprobs_replay"])  # routing_replay=True + routed_experts
    assert torch.equal(out["logprobs_replay_uint8"], out["logprobs_replay"])  # uint8 rows replay bit for bit
    # the routing-off forward that records the routing gives the natural logprobs: one forward, not two
    assert torch.equal(out["natural_forward_logprobs"], out["logprobs_natural"])
    # PP stages replay their own layers (global layer = stage offset + local index): same result.
    pp_gap = (out["pp_logprobs_replay"] - out["logprobs_replay"])[trained].abs().max()
    assert pp_gap < 1e-4, pp_gap


def test_recompute_replays_each_microbatch(world):
    per_rank, *_ = world
    for out in per_rank:
        loss_a, loss_b, norm_a, norm_b, params_equal = out["recompute"]
        assert loss_a == loss_b and norm_a == norm_b and params_equal, out["recompute"]


def test_bad_routing_is_rejected_before_forward(world):
    per_rank, *_ = world
    for out in per_rank:
        shape, out_of_range, duplicate, missing, in_train_step, calls = out["errors"]
        assert "expected an integer tensor (8, 16, 4, 2)" in shape, shape
        assert f"expert id {NUM_EXPERTS} outside [0, {NUM_EXPERTS})" in out_of_range, out_of_range
        assert "twice" in duplicate and "twice" in in_train_step, (duplicate, in_train_step)
        assert "lacks 'routed_experts'" in missing, missing
        assert calls == "router calls: 0"
