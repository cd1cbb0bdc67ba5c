"""Speculative decoding with the MTP layer in the embedded engine (`engines.speculative`).

The acceptance rule alone (its output distribution is the target's); then two engine processes
serving the same DeepSeek-V3 checkpoint with an MTP layer, one speculating with k = 2 drafts and one
not: greedy outputs are equal token for token, sampled outputs carry exactly the logprobs and routed
experts a plain forward over the finished sequence gives (the target's, with rejected drafts rolled
out of the KV cache), and a partial rollout cut by an abort resumes with a draft to the same tokens
and routing, as does a retracted batch. In process: GLM-4.5's MTP layer drafts too, and a version's
draft is built from that version's checkpoint and swapped in with its model, never before or after.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_rl.engine.client import EngineClient
from moe_rl.engine.embedded.draft import mtp_prefix
from moe_rl.engine.embedded.request import Request
from moe_rl.engine.embedded.runner import ModelRunner
from moe_rl.engine.embedded.sampler import draw
from moe_rl.engine.embedded.scheduler import Scheduler
from moe_rl.engine.embedded.speculative import accept
from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from moe_rl.engine.sampling import SamplingParams
from moe_rl.rollout.partial import continuation_request, continue_sample
from moe_rl.sample import Sample
from tests.engine.engine_helpers import engine_load, run, wait_until_decoding, with_client
from tests.tiny_models import DEEPSEEK_V3, GLM4_MOE, hf_config, save_random_model, with_mtp_layer

PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(2 + 3 * i)] for i in range(4)]


def save_mtp_model(path, seed: int = 0, family: dict = DEEPSEEK_V3):
    """The tiny DeepSeek-V3 (or `family`) with one MTP layer (HF layer 4), as an export writes it."""
    config = hf_config(family, num_nextn_predict_layers=1)
    save_random_model(config, path, seed=seed)
    file = path / "model.safetensors"
    save_file(with_mtp_layer(load_file(file), config.to_dict()), str(file), metadata={"format": "pt"})
    return path


# -- the rule -------------------------------------------------------------------------------------


def test_acceptance_rule_outputs_the_target_distribution():
    """Two drafts from q, the rule, the emitted tokens: the first is distributed as p1 and, after a
    kept d1, the second as p2 (the target's; columns independent here), whatever q is. Greedy p and
    q (one-hot) emit argmax p."""
    rows, vocab, k = 400_000, 5, 2
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1)
    uniforms = 1.0 - torch.rand(rows, 2 * k + 1, generator=g)  # in (0, 1]
    drafts = torch.stack([draw(q[j].expand(rows, vocab), uniforms[:, j]) for j in range(k)], dim=1)
    accepted, final = accept(
        p.expand(rows, k + 1, vocab),
        q.expand(rows, k, vocab),
        drafts,
        torch.full((rows,), k),
        uniforms[:, k:-1],
        uniforms[:, -1],
    )
    assert (accepted == 0).any() and (accepted == 1).any() and (accepted == k).any()
    first = torch.where(accepted >= 1, drafts[:, 0], final)
    first_freq = torch.bincount(first, minlength=vocab).float() / rows
    assert (first_freq - p[0]).abs().sum() < 0.01, (first_freq, p[0])
    kept = accepted >= 1
    second = torch.where(accepted[kept] >= 2, drafts[kept, 1], final[kept])
    second_freq = torch.bincount(second, minlength=vocab).float() / int(kept.sum())
    assert (second_freq - p[1]).abs().sum() < 0.015, (second_freq, p[1])
    one_hot = torch.nn.functional.one_hot
    greedy_p = one_hot(torch.tensor([[3, 1, 4]]), vocab).float()
    greedy_q = one_hot(torch.tensor([[3, 2]]), vocab).float()
    accepted, final = accept(
        greedy_p, greedy_q, torch.tensor([[3, 2]]), torch.tensor([2]), torch.ones(1, 2), torch.ones(1)
    )
    assert accepted.tolist() == [1] and final.tolist() == [1]  # d1 = argmax kept; d2 is not: argmax p2


# -- the engine -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory):
    return save_mtp_model(tmp_path_factory.mktemp("deepseek_mtp"))


@pytest.fixture(scope="module")
def engines(mtp_dir):
    """(speculating k = 2, plain) engines on the same checkpoint, one thread each."""
    spec = EmbeddedConfig(model_path=mtp_dir, threads=1, speculative_steps=2)
    with launch_embedded(spec) as speculating, launch_embedded(EmbeddedConfig(model_path=mtp_dir, threads=1)) as plain:
        yield speculating.url, plain.url


async def _generate(url: str, prompts, sampling) -> list:
    client = EngineClient(url)
    try:
        return await asyncio.gather(
            *(client.generate(p, sampling(i), return_routed_experts=True) for i, p in enumerate(prompts))
        )
    finally:
        await client.close()


async def _score(url: str, sequences) -> list:
    client = EngineClient(url)
    try:
        return await asyncio.gather(*(client.score(s) for s in sequences))
    finally:
        await client.close()


@pytest.mark.world
def test_greedy_speculation_equals_plain_greedy(engines):
    speculating, plain = engines

    def greedy(i):
        return SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)

    spec, ref = run(_generate(speculating, PROMPTS, greedy)), run(_generate(plain, PROMPTS, greedy))
    info = run(with_client(speculating, lambda client: client.server_info()))
    assert (info["speculative_algorithm"], info["speculative_num_steps"]) == ("NEXTN", 2)
    assert (info["speculative_eagle_topk"], info["speculative_num_draft_tokens"]) == (1, 3)
    for s, r in zip(spec, ref):
        assert s.output_ids == r.output_ids
        assert np.array_equal(s.routed_experts, r.routed_experts)
        np.testing.assert_allclose(s.logprobs, r.logprobs, atol=1e-5)
        assert s.meta_info["spec_verify_ct"] >= 1 and "spec_verify_ct" not in r.meta_info
        meta = s.meta_info
        assert meta["spec_num_proposed_drafts"] == 2 * meta["spec_verify_ct"]
        # every token but the prefill's comes from a verify: its kept drafts plus one
        assert meta["spec_num_correct_drafts"] + meta["spec_verify_ct"] == len(s.output_ids) - 1


@pytest.mark.world
def test_sampled_tokens_carry_the_targets_logprobs_and_routing(engines):
    """Temperature 1 on a random model: q and p are both near uniform, so drafts are often kept and
    sometimes not. Each token's logprob and routing row equal a plain forward over the finished
    sequence: the target's, and no rejected draft left a trace in the KV cache."""
    speculating, plain = engines

    def sampled(i):
        return SamplingParams(max_new_tokens=30, temperature=1.0, sampling_seed=i, ignore_eos=True)

    results = run(_generate(speculating, PROMPTS, sampled))
    scores = run(_score(plain, [p + r.output_ids for p, r in zip(PROMPTS, results)]))
    correct = proposed = 0
    for prompt, result, score in zip(PROMPTS, results, scores):
        assert len(result.output_ids) == 30
        np.testing.assert_allclose(result.logprobs, score.logprobs[len(prompt) - 1 :], atol=1e-5)
        assert np.array_equal(result.routed_experts, score.routed_experts)
        correct += result.meta_info["spec_num_correct_drafts"]
        proposed += result.meta_info["spec_num_proposed_drafts"]
    assert 0 < correct < proposed  # both kept and rejected drafts happened


@pytest.mark.world
def test_aborted_turn_resumes_with_a_draft(engines):
    """Greedy requests cut by an abort-mode pause, continued as partial rollouts
    (`continuation_request` / `continue_sample`): the same tokens and routing as one plain run."""
    speculating, plain = engines
    sampling = SamplingParams(max_new_tokens=60, temperature=0.0, ignore_eos=True)

    async def cut_and_resume():
        client = EngineClient(speculating)
        try:
            tasks = [asyncio.create_task(client.generate(p, sampling, return_routed_experts=True)) for p in PROMPTS]
            await wait_until_decoding(speculating, len(PROMPTS))
            await client.pause_generation("abort")
            cut = await asyncio.gather(*tasks)
            await client.continue_generation()
            samples = [continue_sample(Sample(prompt_ids=p), r, routed_experts=True) for p, r in zip(PROMPTS, cut)]
            done = []
            for sample in samples:
                ids, start = continuation_request(sample)
                left = SamplingParams(max_new_tokens=60 - len(sample.response_ids), temperature=0.0, ignore_eos=True)
                more = await client.generate(ids, left, return_routed_experts=True, routed_experts_start_len=start)
                done.append(continue_sample(sample, more, routed_experts=True))
            return cut, done
        finally:
            await client.close()

    cut, done = run(cut_and_resume())
    assert any(r.finish_reason == "abort" and 0 < len(r.output_ids) < 60 for r in cut)
    reference = run(_generate(plain, PROMPTS, lambda i: sampling))
    for sample, ref in zip(done, reference):
        assert sample.response_ids == ref.output_ids
        assert np.array_equal(sample.routed_experts, ref.routed_experts)
        np.testing.assert_allclose(sample.rollout_logprobs, ref.logprobs, atol=1e-5)


@pytest.mark.world
def test_retracted_requests_recompute_their_drafts(engines):
    """A retract-mode pause drops the batch's KV (target and draft slots); on continue the requests
    are prefilled again, drafts rebuilt from the prefill: the same greedy tokens and routing."""
    speculating, plain = engines
    sampling = SamplingParams(max_new_tokens=200, temperature=0.0, ignore_eos=True)

    async def retract_midway():
        client = EngineClient(speculating)
        try:
            tasks = [asyncio.create_task(client.generate(p, sampling, return_routed_experts=True)) for p in PROMPTS]
            await wait_until_decoding(speculating, len(PROMPTS))
            assert not any(t.done() for t in tasks), "a request finished before the pause: raise max_new_tokens"
            await client.pause_generation("retract")
            load = await engine_load(speculating)
            assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, len(PROMPTS))  # all retracted
            await client.continue_generation()
            return await asyncio.gather(*tasks)
        finally:
            await client.close()

    results = run(retract_midway())
    reference = run(_generate(plain, PROMPTS, lambda i: sampling))
    for result, ref in zip(results, reference):
        assert result.output_ids == ref.output_ids and result.finish_reason == "length"
        assert np.array_equal(result.routed_experts, ref.routed_experts)


def test_glm45_drafts_with_its_mtp_layer_too(tmp_path):
    """GLM-4.5's MTP layer (same layout as DeepSeek-V3's) drafts in process: greedy tokens and
    routing equal plain decoding's, and verifies ran."""
    model_dir = save_mtp_model(tmp_path, family=GLM4_MOE)

    def greedy(steps: int) -> list[dict]:
        scheduler = Scheduler(ModelRunner(model_dir, speculative_steps=steps), "0", 8)
        futures = [concurrent.futures.Future() for _ in PROMPTS]
        for i, (prompt, future) in enumerate(zip(PROMPTS, futures)):
            params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
            scheduler.submit(
                Request(
                    rid=str(i),
                    input_ids=prompt,
                    params=params,
                    eos_token_ids=frozenset(),
                    return_routed_experts=True,
                    on_done=future.set_result,
                )
            )
        try:
            return [future.result(timeout=120) for future in futures]
        finally:
            scheduler.stop()

    for spec, plain in zip(greedy(2), greedy(0)):
        assert spec["output_ids"] == plain["output_ids"]
        assert spec["meta_info"]["routed_experts"] == plain["meta_info"]["routed_experts"]
        assert spec["meta_info"]["spec_verify_ct"] >= 1


# -- versions -------------------------------------------------------------------------------------


def test_a_version_serves_its_own_draft(tmp_path):
    """A staged version's draft is built from its own checkpoint; the live draft changes only when
    the version is swapped in, together with its model."""
    runner = ModelRunner(save_mtp_model(tmp_path), speculative_steps=2)
    prefix = mtp_prefix(runner.num_layers)
    old = runner.draft
    generator = torch.Generator().manual_seed(1)
    names = [f"{prefix}eh_proj.weight", f"{prefix}self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight"]
    update = {n: torch.randn(runner.checkpoint[n].shape, generator=generator) for n in names}
    staged = runner.build_staged(update)
    assert runner.draft is old and staged.draft is not old  # staged beside the live pair
    assert torch.equal(staged.draft.eh_proj.weight, update[names[0]])
    assert torch.equal(staged.draft.layer.self_attn.o_proj.weight, update[names[1]])
    assert not torch.equal(old.eh_proj.weight, update[names[0]])
    runner.swap(staged)
    assert runner.draft is staged.draft and runner.model is staged.model
    assert torch.equal(runner.model.model.layers[0].self_attn.o_proj.weight, update[names[2]])
    again = runner.build_staged({})  # an in-place load into the spare model skips the MTP tensors
    assert torch.equal(again.draft.eh_proj.weight, update[names[0]])


# -- SGLang (GPU tier) ----------------------------------------------------------------------------


def _gpu_and_sglang() -> bool:
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("sglang") is not None


@pytest.mark.world
@pytest.mark.gpu_sglang
@pytest.mark.skipif(not _gpu_and_sglang(), reason="needs a CUDA GPU and sglang installed")
def test_sglang_speculates_with_the_mtp_layer_and_syncs_it(tmp_path):
    """SGLang with `--speculative-algorithm NEXTN` (k = 2) on the tiny DeepSeek-V3 with an MTP layer:
    greedy outputs and routed experts equal a plain SGLang's, meta info counts the verifies, and a
    weight sync over NCCL (target and MTP tensors) commits one version that keeps speculating."""
    from moe_rl.engine.embedded.runner import load_checkpoint_state
    from moe_rl.engine.sglang_launcher import SGLangConfig, launch_sglang
    from sync.config import SyncConfig
    from sync.sender import WeightSender

    model_dir = save_mtp_model(tmp_path / "m")
    new_state = load_checkpoint_state(save_mtp_model(tmp_path / "new", seed=1))
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)

    def serve(steps: int):
        return launch_sglang(SGLangConfig(model_path=str(model_dir), mem_fraction_static=0.3, speculative_steps=steps))

    async def generate(url: str) -> list:
        client = EngineClient(url, kind="sglang", num_hidden_layers=4, topk=2)
        try:
            return await asyncio.gather(*(client.generate(p, greedy, return_routed_experts=True) for p in PROMPTS))
        finally:
            await client.close()

    with serve(0) as plain:
        reference = run(generate(plain.url))
    with serve(2) as engine:
        results = run(generate(engine.url))
        client = EngineClient(engine.url, kind="sglang", num_hidden_layers=4, topk=2)
        sender = WeightSender([client], SyncConfig(transport="broadcast", backend="nccl", bucket_bytes=1 << 20))
        try:
            stats = sender.update(sorted(new_state.items()), 1)
        finally:
            sender.close()
        after = run(generate(engine.url))
    for result, ref, prompt in zip(results, reference, PROMPTS):
        assert result.output_ids == ref.output_ids
        assert np.array_equal(result.routed_experts, ref.routed_experts)
        assert result.routed_experts.shape[0] == len(prompt) + 16 - 1
        assert result.meta_info["spec_verify_ct"] >= 1
    assert stats.version == 1 and all(r.weight_version == 1 and r.meta_info["spec_verify_ct"] >= 1 for r in after)


def test_speculative_config_is_checked_before_start():
    from moe_rl.config import load_config

    bench = "configs/bench/spec_mtp_copy.yaml"
    config = load_config(bench)
    assert config.engines.speculative.algorithm == "mtp" and config.engines.speculative.steps == 2
    for override in ("model.hf_config.num_nextn_predict_layers=0", "model.mtp=drop"):
        with pytest.raises(ValueError, match="engines.speculative: the model has no MTP layer"):
            load_config(bench, [override])
    with pytest.raises(ValueError, match=r"engines.speculative.steps=0: must be an integer in \[1, 8\]"):
        load_config(bench, ["engines.speculative.steps=0"])
    with pytest.raises(ValueError, match="engines.speculative.algorithm='eagle3'"):
        load_config(bench, ["engines.speculative.algorithm=eagle3"])
