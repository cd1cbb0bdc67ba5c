"""Speculative rollout (`engines.speculative`) against SGLang 0.5.23's own code (conformance tier).

1. The launcher's NEXTN flags (`sglang_launcher.speculative_args`) through SGLang's argument parser
   and `ServerArgs`: a chain of k MTP drafts, k + 1 tokens verified per forward.
2. Weight sync into a speculating SGLang: a twin whose ranks have a draft runner (`sglang_twin`,
   `draft=True`); the project's `WeightSender` syncs versions and SGLang's manager fans every bucket
   out to target and draft: after each version, the draft holds that version's MTP layer bit for bit
   and the served label is that version (one commit for both).
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load_file

from moe_rl.engine.client import EngineClient
from moe_rl.engine.sglang_launcher import SGLangConfig, sglang_command
from sync.config import SyncConfig
from sync.sender import WeightSender
from tests.conformance import sglang_oracle
from tests.conformance.sglang_twin import SGLangTwin
from tests.engine.test_engine_speculative import save_mtp_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.world]

SPECULATIVE = (
    "speculative_algorithm",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
)


def _parse_speculative(argvs: list[list[str]]) -> list[dict]:
    import argparse

    from sglang.srt.server_args import ServerArgs

    parsed = []
    for argv in argvs:
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        namespace, unknown = parser.parse_known_args(argv)
        parsed.append({"unknown": unknown, **{name: getattr(namespace, name) for name in SPECULATIVE}})
    return parsed


def test_sglangs_parser_takes_the_speculative_flags():
    steps = (1, 3)
    commands = [sglang_command(SGLangConfig(model_path="/models/dsv3", speculative_steps=k), 30008) for k in steps]
    parsed = sglang_oracle.call(_parse_speculative, [command[3:] for command in commands])
    assert parsed == [
        {
            "unknown": [],
            "speculative_algorithm": "NEXTN",
            "speculative_num_steps": k,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": k + 1,
        }
        for k in steps
    ]
    assert "--speculative-algorithm" not in sglang_command(SGLangConfig(model_path="/m"), 30008)


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def test_the_draft_takes_each_version_with_the_target(tmp_path):
    model_dir = save_mtp_model(tmp_path / "m")
    base = load_file(str(model_dir / "model.safetensors"))
    mtp = [name for name in base if name.startswith("model.layers.4.")]
    assert any("eh_proj" in name for name in mtp)
    with SGLangTwin(str(model_dir), tp_size=1, draft=True) as twin:
        client = EngineClient(twin.url, kind="sglang", retries=1, timeout_s=60)
        sender = WeightSender([client], SyncConfig(transport="broadcast", bucket_bytes=16 << 10, timeout_s=60))
        try:
            for version in (1, 2):
                generator = torch.Generator().manual_seed(version)
                weights = {n: t + torch.randn(t.shape, generator=generator).to(t.dtype) for n, t in base.items()}
                sender.update(sorted(weights.items()), version)
                (state,) = twin.state()
                assert state["version"] == str(version)
                assert state["weights"] == {n: _digest(t) for n, t in weights.items()}
                assert state["draft_weights"] == {n: _digest(weights[n]) for n in mtp}, version
        finally:
            sender.close()
