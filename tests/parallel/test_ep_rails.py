"""EP gathers that reach the root's node through several NICs (`parallel.gathers.Rails`).

On 8-rank gloo worlds whose ranks say they sit on different nodes (torchrun's `GROUP_RANK`, which
`parallel.world.node_names` reads), `init_model_parallel` forms the rails: the EP members on the
root's node each take a share of the off-node members and forward it to the root. The export is
then bit-equal to the one-hop gather's (every name, dtype and byte, FP8 included), and the bytes
that cross nodes arrive spread over the rails: each rail takes its riders' bytes, together exactly
what the one-hop gather brought into the root alone.
"""

from __future__ import annotations

import pytest
import torch

from parallel.fp8 import BlockFP8
from parallel.layout import ParallelLayout
from parallel.world import spawn
from tests.tiny_models import QWEN3_MOE, hf_config

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

CASES = [
    # EP8 on nodes of 3 GPUs: rails 0, 1, 2 on the root's node take [3, 6], [4, 7] and [5]
    (ParallelLayout(world_size=8, ep=8), 3, [2, 2, 1]),
    # PP2 x EP4 on nodes of 2: each stage's root and its node-mate take one off-node member each
    (ParallelLayout(world_size=8, pp=2, ep=4), 2, [1, 1]),
]


def _export_with_and_without_rails(config: dict, layout: ParallelLayout, node_size: int, fp8: BlockFP8 | None):
    """Rank function: (is the stage source, the export with rails, without, the bytes this rank
    received across nodes with rails, the bytes it received with the one-hop gather)."""
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state

    from parallel.bridges import bridge_for
    from parallel.context import init_ep_rails, parallel_context
    from parallel.export import export_hf_weights, is_export_source
    from parallel.gathers import GATHER_BYTES
    from parallel.model import build_gpt_model, init_model_parallel

    os.environ["GROUP_RANK"] = str(dist.get_rank() // node_size)  # the node this rank says it is on
    bridge = bridge_for(config)
    init_model_parallel(layout, seed=0)
    model = build_gpt_model(bridge, layout)
    with torch.no_grad():  # experts that differ per EP member (a random init may repeat them), so order shows
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.add_(dist.get_rank())
    has_rails = parallel_context(model, bridge).ep_rails is not None
    before = dict(GATHER_BYTES)
    railed = list(export_hf_weights(model, bridge, bucket_bytes=1 << 20, fp8=fp8))
    across = GATHER_BYTES["received_across_nodes"] - before["received_across_nodes"]
    init_ep_rails(["one node"] * dist.get_world_size())  # the same world, the one-hop gather
    assert parallel_context(model, bridge).ep_rails is None
    before = dict(GATHER_BYTES)
    flat = list(export_hf_weights(model, bridge, bucket_bytes=1 << 20, fp8=fp8))
    received = GATHER_BYTES["received"] - before["received"]
    source = is_export_source()
    parallel_state.destroy_model_parallel()
    as_bytes = lambda tensors: [(name, str(t.dtype), _bytes(t)) for name, t in tensors]  # noqa: E731 - FP8 does not unpickle
    return source, has_rails, as_bytes(railed), as_bytes(flat), across, received


@pytest.mark.parametrize("fp8", [None, BlockFP8(16, 16)], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout,node_size,riders", CASES, ids=["ep8-nodes-of-3", "pp2-ep4-nodes-of-2"])
def test_rails_export_equals_one_hop_and_spread_the_bytes(layout, node_size, riders, fp8):
    config = hf_config(QWEN3_MOE, num_hidden_layers=2, num_experts=8).to_dict()
    ranks = spawn(_export_with_and_without_rails, 8, config, layout, node_size, fp8)
    stage_ranks = layout.world_size // layout.pp
    roots = [stage * stage_ranks for stage in range(layout.pp)]
    for rank, (source, has_rails, railed, flat, _, _) in enumerate(ranks):
        assert has_rails, rank  # every rank of these EP groups takes part in the two hops
        assert [(n, d) for n, d, _ in railed] == [(n, d) for n, d, _ in flat], rank
        for (name, _, got), (_, _, want) in zip(railed, flat):
            assert torch.equal(got, want), (rank, name)
        assert source == (rank in roots) and (not source or flat), rank
    for root in roots:
        ep = layout.ep
        off_node = ep - sum((root + m) // node_size == root // node_size for m in range(ep))
        # bytes of one member's share: what the one-hop root received, per member it received from
        share = ranks[root][5] / (ep - 1)
        rails = [ranks[root + r][4] for r in range(len(riders))]
        assert rails == [n * share for n in riders], (root, rails, share)
        assert sum(rails) == off_node * share  # what one NIC carried before, now over len(riders)
        assert share > 0


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)
