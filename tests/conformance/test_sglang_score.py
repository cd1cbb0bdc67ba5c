"""Scoring exact ids (`EngineClient.score`: the consistency probe's and a served teacher's route)
against SGLang 0.5.23's own code (conformance tier).

The body the client sends is a prefill-only GenerateReqInput SGLang accepts (`max_new_tokens=0`,
`logprob_start_len=0`), and the embedded engine answers it in SGLang's shape: `input_token_logprobs`
as SGLang's scheduler (`SchedulerLogprobResultProcessor._process_input_token_logprobs`: None for the
first token, the sampling position dropped) and tokenizer manager (`detokenize_logprob_tokens`) build
it from the prefill's per-position logprobs; finish reason SGLang's `FINISH_LENGTH(length=0)`; no
output ids; routed experts for `seqlen - 1` rows, where a prefill-only request's seqlen is the prompt
alone (`_maybe_collect_routed_experts` counts `output_ids[:finished_len]`, and `update_finish_state`
sets finished_len = max_new_tokens = 0).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from moe_rl.engine.client import EngineClient, EngineError
from moe_rl.engine.process import EmbeddedConfig, launch_embedded
from moe_rl.sample import decode_routed_experts
from tests.conformance import sglang_oracle
from tests.conformance.test_sglang_client_bodies import VOCAB, _check_with_sglang
from tests.conformance.test_sglang_requests import REQUEST_CLASSES
from tests.engine.engine_helpers import run, save_tiny_model
from tests.engine.test_engine_requests import RecordingEngine, post

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

IDS = [3, 1, 4, 1, 5, 9, 2, 6]


def _score_body() -> dict:
    """The body `EngineClient.score(IDS)` sends (recorded; the recording engine's canned answer
    has no prompt logprobs, which the client refuses)."""

    async def go():
        engine = RecordingEngine()
        client = EngineClient(await engine.start(), kind="sglang", backoff_s=0.01)
        try:
            with pytest.raises(EngineError, match="0 prompt logprobs"):
                await client.score(IDS)
        finally:
            await client.close()
            await engine.runner.cleanup()
        (body,) = [body for path, body in engine.bodies if path == "/generate"]
        return body

    return run(go())


def _sglang_response(ids: list[int], per_position: list[float]) -> dict:
    """Oracle process: SGLang's `input_token_logprobs` and finish reason for a prefill-only request
    with logprob_start_len 0 whose prefill computed `per_position` (position t: log p(ids[t + 1]),
    the last one the sampling position's)."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.managers.scheduler_components import logprob_result_processor

    detokenize = sglang_oracle.extract(
        "sglang.srt.managers.tokenizer_manager", "TokenizerManager.detokenize_logprob_tokens", {"List": list}
    )
    # the server's execution flags, unpublished outside a scheduler: MIS scoring off (its default)
    logprob_result_processor.get_exec = lambda: SimpleNamespace(features=SimpleNamespace(enable_mis=False))
    processor = logprob_result_processor.SchedulerLogprobResultProcessor(model_config=SimpleNamespace(vocab_size=VOCAB))
    # a prefill-only request that pools no positions: the regular layout (no scoring positions)
    req = SimpleNamespace(
        logprob=SimpleNamespace(),
        origin_input_ids=ids,
        logprob_start_len=0,
        is_prefill_only=True,
        token_indices_to_pool=None,
        multi_item_delimiter_indices=None,
    )
    processor._process_input_token_logprobs(req, per_position)
    entries = detokenize(None, req.logprob.input_token_logprobs_val, req.logprob.input_token_logprobs_idx, False)
    return {"input_token_logprobs": json.loads(json.dumps(entries)), "finish_reason": FINISH_LENGTH(length=0).to_json()}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))
    with launch_embedded(EmbeddedConfig(model_path=model, threads=1)) as engine:
        yield engine


def test_the_score_body_is_a_prefill_only_request_sglang_accepts():
    body = _score_body()
    assert body["sampling_params"]["max_new_tokens"] == 0 and body["logprob_start_len"] == 0
    assert body["return_logprob"] and body["return_routed_experts"] and body["input_ids"] == IDS
    assert sglang_oracle.call(_check_with_sglang, [("/generate", body)], REQUEST_CLASSES, VOCAB) == []


def test_the_engine_answers_in_sglangs_shape(engine):
    status, text = post(engine.url + "/generate", _score_body())
    assert status == 200, text
    answer = json.loads(text)
    meta = answer["meta_info"]
    served = [entry[0] for entry in meta["input_token_logprobs"][1:]]
    expected = sglang_oracle.call(_sglang_response, IDS, served + [0.0])
    assert meta["input_token_logprobs"] == expected["input_token_logprobs"]
    assert meta["finish_reason"] == expected["finish_reason"]
    assert answer["output_ids"] == [] and meta["output_token_logprobs"] == [] and meta["completion_tokens"] == 0
    assert decode_routed_experts(meta["routed_experts"], 3, 2).shape == (len(IDS) - 1, 3, 2)

    async def score():
        client = EngineClient(engine.url)
        try:
            return await client.score(IDS)
        finally:
            await client.close()

    scored = run(score())
    assert scored.logprobs == served and scored.weight_version == int(meta["weight_version"]) == 0
