"""Helpers for rollout tests: a pool that records every engine request, and a transformers reference."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import torch

from moe_rl.engine.client import EngineClient
from moe_rl.engine.pool import EnginePool
from tests.rollout.conftest import LAYERS, TOPK


class RecordingPool(EnginePool):
    """A real EnginePool that also keeps (input_ids, request, result) of every generate call, the
    request's fields in one dict (the sampling params' and the call's keywords)."""

    def __init__(self, clients):
        super().__init__(clients)
        self.calls = []

    async def generate(self, input_ids, sampling, *, group_id=None, **kwargs):
        result = await super().generate(input_ids, sampling, group_id=group_id, **kwargs)
        self.calls.append((list(input_ids), {**dataclasses.asdict(sampling), **kwargs}, result))
        return result


def make_pool(url: str, recording: bool = False) -> EnginePool:
    client = EngineClient(url, num_hidden_layers=LAYERS, topk=TOPK)
    return RecordingPool([client]) if recording else EnginePool([client])


async def swap_weights(pool: EnginePool, model_dir, version: int, mode: str = "abort") -> None:
    """What the orchestrator does for one weight update: pause, load, resume."""
    for client in pool.clients:
        await client.pause_generation(mode)
        await client.update_weights_from_disk(str(model_dir), str(version))
        await client.continue_generation()


_distinct = itertools.count()


def every_third_group_flat(response, answer, sample) -> float:
    """A reward with known variance: groups g*-0, g*-3, ... score 0.0 for every sample (zero
    variance); every other sample gets a reward of its own. Makes the filters deterministic."""
    if int(sample.group_id.rsplit("-", 1)[1]) % 3 == 0:
        return 0.0
    return float(next(_distinct))


async def cancel(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@torch.no_grad()
def reference(model_dir, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' log-softmax [len, V] and top-k routing [len, layers, topk] on `ids`."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    routing = torch.stack([torch.topk(r, TOPK, dim=-1).indices for r in out.router_logits], dim=1)
    return torch.log_softmax(out.logits[0].float(), -1), routing.to(torch.int32)
