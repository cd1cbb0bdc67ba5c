"""The embedded engine's model runner and scheduler in-process (no server): weight swaps through the
spare model, and prefill-only requests that a full batch does not hold back."""

from __future__ import annotations

import threading

import pytest
import torch

from moe_rl.engine.embedded.request import Request
from moe_rl.engine.embedded.runner import ModelRunner
from moe_rl.engine.embedded.scheduler import Scheduler
from moe_rl.engine.sampling import SamplingParams
from tests.tiny_models import DEEPSEEK_V3, GLM4_MOE, MIXTRAL, QWEN3_MOE, hf_config, save_random_model

FAMILIES = {
    "qwen3_moe": None,
    "tied-embeddings": hf_config(QWEN3_MOE, tie_word_embeddings=True),
    "glm4_moe": hf_config(GLM4_MOE),
    "deepseek_v3": hf_config(DEEPSEEK_V3),
    "mixtral": hf_config(MIXTRAL),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_updates_load_into_the_spare_model_exactly_as_a_fresh_build(qwen3_dir, tmp_path, family):
    config = FAMILIES[family]
    runner = ModelRunner(qwen3_dir if config is None else save_random_model(config, tmp_path))
    first = runner.model
    generator = torch.Generator().manual_seed(0)
    for update in range(4):
        names = sorted(runner.checkpoint)[update % 2 :: 2]  # a different half of the tensors each time
        tensors = {n: torch.randn(runner.checkpoint[n].shape, generator=generator) for n in names}
        staged = runner.build_staged(tensors)
        merged = staged.checkpoint
        assert staged.model is not runner.model  # staged beside the live model, which keeps serving
        runner.swap(staged)
        # update 0 builds a model; later ones load into the model the previous swap replaced, as the
        # copies of the load plan found at update 1 (checked there against the converter)
        assert (runner.model is first) == (update % 2 == 1)
        assert (runner._plan is not None) == (update >= 1) and not runner._converter_only
        if family == "tied-embeddings":  # the checkpoint has no lm_head: the head stays the embedding itself
            assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
        fresh = runner._build(merged)
        assert fresh.state_dict().keys() == runner.model.state_dict().keys()
        for name, tensor in fresh.state_dict().items():
            assert torch.equal(tensor, runner.model.state_dict()[name]), (update, name)


def test_a_full_batch_does_not_hold_back_a_prefill_only_request(qwen3_dir):
    runner = ModelRunner(qwen3_dir)
    scheduler = Scheduler(runner, "0", max_batch=2)
    done = {}
    finished = threading.Event()

    def request(rid: str, max_new_tokens: int) -> Request:
        def on_done(result):
            done[rid] = result
            if rid == "score":
                finished.set()

        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        return Request(rid=rid, input_ids=[1, 2, 3], params=params, eos_token_ids=frozenset(), on_done=on_done)

    try:
        # the batch is full of long requests before the score arrives
        scheduler.call(lambda: scheduler.pause("in_place")).result()
        for rid in ("a", "b", "c"):
            scheduler.submit(request(rid, 10_000))
        scheduler.submit(request("score", 0))
        scheduler.call(scheduler.unpause).result()
        assert finished.wait(timeout=120)
        # answered while both slots still decode, and before the request queued ahead of it
        assert done["score"]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        running, waiting, _, _ = scheduler.call(scheduler.load).result()
        assert (running, waiting) == (2, 1) and "c" not in done
    finally:
        scheduler.call(lambda: scheduler.abort(None)).result()
        scheduler.stop()
