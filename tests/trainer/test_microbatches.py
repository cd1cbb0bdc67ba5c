"""Token-budget micro-batches without processes: Karmarkar-Karp balance, every row placed once,
the budget kept, equal micro-batch counts on every DP rank, and micro-batches cut to their rows."""

import random

import torch

from moe_rl.trainer.microbatches import (
    budget_plan,
    equalize_counts,
    karmarkar_karp,
    pack_by_budget,
    pack_microbatch,
    padded_length,
    row_lengths,
    take_rows,
)


def batch_of(lengths: list[int], width: int | None = None) -> dict[str, torch.Tensor]:
    """Rows of tokens 1.. up to each length (prompt of 2), padding token 0 / loss_mask 0 after."""
    width = width or max(lengths)
    tokens = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for row, length in enumerate(lengths):
        tokens[row, :length] = torch.arange(1, length + 1)
        mask[row, 2:length] = 1
    return {"tokens": tokens, "loss_mask": mask, "advantages": mask.float() * (torch.arange(len(lengths))[:, None])}


def long_tail(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(max(int(rng.lognormvariate(4.0, 0.8)), 3), 600) for _ in range(count)]


def test_row_lengths_follow_the_last_real_token_or_trained_position():
    batch = batch_of([5, 3, 9], width=12)
    batch["tokens"][1, 2] = 0  # a real token 0 inside a row is still inside it
    assert row_lengths(batch) == [5, 3, 9]
    batch["tokens"][2, 7:9] = 0  # trailing real zeros of a trained position count through the mask
    assert row_lengths(batch) == [5, 3, 9]
    assert row_lengths(batch_of([1], width=4)) == [2]  # at least one input and one target


def test_karmarkar_karp_balances_at_least_as_well_as_greedy_and_places_every_row_once():
    for seed in range(20):
        lengths = long_tail(64, seed)
        for parts in (2, 4, 8):
            sets = karmarkar_karp(lengths, parts)
            assert sorted(i for s in sets for i in s) == list(range(len(lengths)))
            sums = [sum(lengths[i] for i in s) for s in sets]
            # greedy LPT (longest first to the lightest part) is within 4/3 of optimal; KK does better
            greedy = [0] * parts
            for length in sorted(lengths, reverse=True):
                greedy[greedy.index(min(greedy))] += length
            assert max(sums) - min(sums) <= max(greedy) - min(greedy)
            assert max(sums) <= sum(lengths) / parts + max(lengths)
    assert karmarkar_karp([5, 5, 5, 5], 2) == karmarkar_karp([5, 5, 5, 5], 2)  # deterministic
    assert sorted(len(s) for s in karmarkar_karp([7], 3)) == [0, 0, 1]


def test_budget_is_kept_and_rows_are_longest_first():
    lengths = long_tail(100, 1)
    for budget, multiple in ((600, 1), (1000, 2), (2048, 4)):
        groups = pack_by_budget(list(range(100)), lengths, budget, multiple)
        assert sorted(r for g in groups for r in g) == list(range(100))
        for group in groups:
            width = padded_length(lengths[group[0]], multiple)
            assert all(lengths[r] <= lengths[group[0]] for r in group)
            assert len(group) * width <= budget or len(group) == 1


def test_every_dp_rank_gets_the_same_number_of_microbatches():
    for seed in range(10):
        lengths = long_tail(32, seed)
        batch = batch_of(lengths)
        for dp in (1, 2, 4):
            plan = budget_plan(row_lengths(batch), dp, 1200)
            assert len({len(groups) for groups in plan}) == 1
            rows = sorted(r for groups in plan for g in groups for r in g)
            assert rows == list(range(32))
            for groups in plan:
                assert all(len(g) * padded_length(max(lengths[r] for r in g), 1) <= 1200 for g in groups if len(g) > 1)
    # a rank with one row and another with three micro-batches: it splits nothing, adds padding
    assert equalize_counts([[0]], 3, [10]) == [[0], [], []]
    assert equalize_counts([[0, 1, 2, 3]], 2, [9, 8, 7, 6]) == [[0, 1], [2, 3]]


def test_microbatches_are_cut_to_their_longest_row_and_keep_row_indices():
    batch = batch_of([4, 11, 6, 2], width=12)
    part = take_rows(batch, [2, 0], multiple=1)
    assert part.rows == [2, 0] and part.batch["tokens"].shape == (2, 6)
    assert torch.equal(part.batch["advantages"], batch["advantages"][[2, 0], :6])
    part = take_rows(batch, [2, 0], multiple=4)  # sequence parallel: inputs a multiple of 4
    assert part.batch["tokens"].shape == (2, 9)
    empty = take_rows(batch, [], multiple=2)
    assert empty.rows == [] and empty.batch["tokens"].shape == (1, 3) and not empty.batch["loss_mask"].any()


def test_plan_pads_little_and_balances_the_work_on_a_long_tail():
    """Rows packed longest first over the whole batch, micro-batches spread by their tokens: on a
    long tail (DAPO-like: 512-token prompts, responses lognormal around 2K, capped at 16K) over 8
    DP ranks, under 5% of the computed tokens are padding and no rank computes more than 10% over
    the mean (packing each rank's share of rows first padded ~12% here)."""
    rng = random.Random(0)
    lengths = [512 + min(max(int(rng.lognormvariate(7.6, 1.0)), 1), 16384) for _ in range(512)]
    plan = budget_plan(lengths, 8, 32768)
    assert sorted(r for groups in plan for g in groups for r in g) == list(range(512))
    work = [sum(max(len(g), 1) * max([lengths[r] for r in g] or [2]) for g in groups) for groups in plan]
    assert sum(lengths) / sum(work) >= 0.95
    assert max(work) <= 1.10 * sum(work) / len(work)


def test_pack_microbatch_concatenates_rows_and_round_trips():
    """Packed: each row's inputs (real length - 1) in row order, a padding tail to the multiple as
    a segment of its own, positions from 0 per segment; `unpack` restores every input-side
    tensor exactly where a row has inputs and gives 0 past them."""
    batch = batch_of([7, 3, 5, 2], width=9)
    batch["routed_experts"] = torch.arange(4 * 9 * 3 * 2).reshape(4, 9, 3, 2).to(torch.uint8)
    part = take_rows(batch, [0, 2, 1, 3], multiple=4)  # width 9 - the model inputs: 8, a multiple of 4
    packed = pack_microbatch(part, multiple=4)
    packing = packed.packing
    assert packed.rows == part.rows and packed.batch is part.batch
    assert packing.lengths == [6, 4, 2, 1] and packing.width == 8
    assert packing.total == 16  # 13 inputs, padded to a multiple of 4
    assert packing.cu_seqlens.tolist() == [0, 6, 10, 12, 13, 16] and packing.cu_seqlens.dtype == torch.int32
    assert packing.positions.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 1, 0, 0, 1, 2]]
    assert packing.max_seqlen == 6
    inputs = packing.pack(part.batch["tokens"][:, :-1])
    expected = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 1, 2, 1, 0, 0, 0]  # rows 0, 2, 1, 3 (take_rows' order)
    assert inputs.shape == (1, 16) and inputs.tolist() == [expected]
    for key, tensor in part.batch.items():
        side = tensor[:, :-1]
        packed_side = packing.pack(side)
        assert packed_side.shape == (1, 16, *side.shape[2:]) and packed_side.dtype == side.dtype
        assert not packed_side[0, 13:].any()  # the padding tail
        back = packing.unpack(packed_side)
        for row, length in enumerate(packing.lengths):
            assert torch.equal(back[row, :length], side[row, :length]), key
            assert not back[row, length:].any(), key
    assert packing.pack(part.batch["loss_mask"][:, 1:]).sum() == part.batch["loss_mask"].sum()  # every trained token


def test_pack_microbatch_without_padding_and_for_a_padding_microbatch():
    batch = batch_of([5, 4])
    packing = pack_microbatch(take_rows(batch, [0, 1])).packing
    assert packing.total == 7 and packing.cu_seqlens.tolist() == [0, 4, 7] and packing.max_seqlen == 4
    empty = pack_microbatch(take_rows(batch, [], multiple=2), multiple=2).packing  # one row of padding
    assert empty.total == 2 and empty.cu_seqlens.tolist() == [0, 1, 2]
    assert packing.unpack(packing.pack(torch.ones(2, 4, requires_grad=True))).requires_grad


def test_a_packed_microbatch_moves_whole_to_a_device():
    """`Microbatch.to`: every tensor of its rows and of its packing lands on the device (the
    trainer moves each micro-batch to its GPU as the schedule takes it; a packing left on the
    host would index GPU rows from the host). The meta device stands in for a GPU here."""
    part = pack_microbatch(take_rows(batch_of([7, 3, 5]), [0, 1, 2], multiple=2), multiple=2)
    moved = part.to(torch.device("meta"))
    packing = moved.packing
    tensors = [*moved.batch.values(), packing.index, packing.cu_seqlens, packing.positions]
    assert all(t.is_meta for t in tensors) and moved.rows == part.rows
    assert (packing.lengths, packing.total, packing.max_seqlen) == (
        part.packing.lengths,
        part.packing.total,
        part.packing.max_seqlen,
    )
    assert not part.batch["tokens"].is_meta  # the host micro-batch is left as it was
