"""`parallel.context_parallel`: the chunks each CP rank holds are megatron-core's and Transformer
Engine's, and gathering them back is exact, forward and backward.

The oracles are megatron-core's own: `get_batch_on_this_cp_rank` (how Megatron-LM splits an
unpacked batch, and what its RoPE's `get_pos_emb_on_this_cp_rank` assumes) and the per-segment
positions its THD RoPE gives a CP rank (`_get_thd_freqs_on_this_cp_rank`); on a GPU with TE, TE's
`thd_get_partitioned_indices`, which Megatron-LM splits packed batches with.
"""

import inspect

import pytest
import torch

from parallel.context_parallel import ContextSplit, held_index
from parallel.world import spawn

CP = 4
SEGMENTS = [8, 24, 16]  # a packed sequence: each segment a multiple of 2 x CP


def _megatron_split(segments: list[int]) -> dict:
    import torch.distributed as dist

    from parallel import cpu_compat

    cpu_compat.apply()
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank
    from megatron.core.utils import get_batch_on_this_cp_rank

    rank, size = dist.get_rank(), dist.get_world_size()
    whole = sum(segments)
    # megatron-core 0.19 added a required `is_hybrid_cp` (False: per-sequence balancing without cu_seqlens)
    hybrid = (
        {"is_hybrid_cp": False} if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters else {}
    )
    unpacked = get_batch_on_this_cp_rank({"tokens": torch.arange(whole)[None]}, cp_group=dist.group.WORLD, **hybrid)
    starts = torch.tensor([0, *segments]).cumsum(0).tolist()
    packed = [  # the positions megatron's THD RoPE gives this rank's share of each segment
        start + _get_thd_freqs_on_this_cp_rank(rank, size, torch.empty(length // size), torch.arange(length))
        for start, length in zip(starts, segments)
    ]
    return {"unpacked": unpacked["tokens"][0], "packed": torch.cat(packed)}


@pytest.mark.world  # starts processes (tests/conftest.py)
def test_held_chunks_are_megatrons():
    for rank, split in enumerate(spawn(_megatron_split, CP, SEGMENTS)):
        assert torch.equal(split["unpacked"], held_index([sum(SEGMENTS)], CP, rank))
        assert torch.equal(split["packed"], held_index(SEGMENTS, CP, rank))


def test_held_chunks_cover_the_sequence_once():
    held = torch.cat([held_index(SEGMENTS, CP, rank) for rank in range(CP)])
    assert torch.equal(held.sort().values, torch.arange(sum(SEGMENTS)))
    with pytest.raises(ValueError, match="2 x cp = 8 chunks"):
        held_index([12], CP, 0)


def _gather() -> dict:
    import torch.distributed as dist

    rank = dist.get_rank()
    whole = torch.arange(sum(SEGMENTS) * 3, dtype=torch.float64).reshape(1, -1, 3)
    split = ContextSplit(dist.group.WORLD, SEGMENTS)
    out = {}
    for sum_grads in (False, True):
        local = split.local(whole, dim=1).clone().requires_grad_()
        gathered = split.gather(local, dim=1, sum_grads=sum_grads)
        weight = (rank + 1) * (torch.arange(whole.numel(), dtype=torch.float64) - 50).reshape(whole.shape)
        (gathered * weight).sum().backward()
        out[sum_grads] = (gathered.detach(), local.grad, split.index)
    return out


@pytest.mark.world
def test_gather_is_exact_and_its_two_backwards():
    """Forward: every rank gets the whole sequence back. Backward: each rank's own weight at its
    tokens (the same loss on every rank), or the sum of all ranks' weights there (keys and values)."""
    whole = torch.arange(sum(SEGMENTS) * 3, dtype=torch.float64).reshape(1, -1, 3)
    base = (torch.arange(whole.numel(), dtype=torch.float64) - 50).reshape(whole.shape)  # integers: exact sums
    for rank, out in enumerate(spawn(_gather, CP)):
        for sum_grads, (gathered, grad, index) in out.items():
            assert torch.equal(gathered, whole)
            factor = sum(range(1, CP + 1)) if sum_grads else rank + 1
            assert torch.equal(grad, factor * base[:, index])


@pytest.mark.gpu_te
def test_held_chunks_are_transformer_engines():
    """TE's own partitioning of a packed batch (what Megatron-LM's get_thd_batch_on_this_cp_rank uses)."""
    tex = pytest.importorskip("transformer_engine_torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cu_seqlens = torch.tensor([0, *SEGMENTS], device="cuda").cumsum(0).to(torch.int32)
    for rank in range(CP):
        index = tex.thd_get_partitioned_indices(cu_seqlens, sum(SEGMENTS), CP, rank)
        assert torch.equal(index.cpu().long(), held_index(SEGMENTS, CP, rank))
