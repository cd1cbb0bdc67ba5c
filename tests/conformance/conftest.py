"""The conformance tier: the project's SGLang path checked against SGLang 0.5.23's own code on CPU.

The first use downloads SGLang's wheel and a few small packages into `.cache/` (see
`tests/conformance/sglang_oracle.py`); nothing is installed into the project's environment."""

import pytest
import torch

from tests.conformance import sglang_oracle
from tests.conformance.sglang_twin import SGLangTwin
from tests.tiny_models import QWEN3_MOE_SMALL, hf_config, save_random_model


@pytest.fixture(scope="session", autouse=True)
def sglang_wheel():
    return sglang_oracle.ensure()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Initial weights (version 0) of a tiny model, as SGLang's twin loads them."""
    path = tmp_path_factory.mktemp("sglang_twin")
    config = hf_config(QWEN3_MOE_SMALL, vocab_size=64, max_position_embeddings=64, norm_topk_prob=False)
    save_random_model(config, path, seed=0, dtype=torch.bfloat16)  # per-expert HF names on disk
    return str(path)


@pytest.fixture
def twins(model_dir):
    """Two SGLang twins of TP 2 on `model_dir`, ready; stopped afterwards."""
    pair = [SGLangTwin(model_dir, tp_size=2).start() for _ in range(2)]
    try:
        yield [twin.wait_ready() for twin in pair]
    finally:
        for twin in pair:
            twin.stop()
