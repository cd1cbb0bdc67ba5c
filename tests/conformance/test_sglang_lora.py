"""The client's LoRA bodies and tensor payloads against SGLang 0.5.23's own code (conformance tier):
each body parses into SGLang's request class; each rank's payload, decoded by SGLang's
`BaseTpWorker.load_lora_adapter_from_tensors` (deserializer, flattened bucket, checksum check), gives
the exact tensors; and the SGLang twin's LoRA routes (SGLang's tokenizer-side rules and registry over
two TP ranks) take the client's loads and unloads."""

from __future__ import annotations

import asyncio
import io

import pytest
import torch
from safetensors.torch import save_file

from moe_rl.engine.client import EngineClient, EngineError
from moe_rl.engine.lora_tensors import LoraTensorsBody, tensor_sha256
from tests.conformance import sglang_oracle
from tests.conformance.sglang_twin import SGLangTwin
from tests.conformance.test_sglang_client_bodies import VOCAB, _check_with_sglang
from tests.conformance.test_sglang_requests import REQUEST_CLASSES
from tests.engine.test_engine_requests import RecordingEngine
from tests.tiny_models import QWEN3_MOE_SMALL, hf_config, save_random_model

pytestmark = pytest.mark.world  # starts processes: a world, an engine, Ray or a CLI (tests/conftest.py)

CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "gate_proj"]}


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for i, (out_features, in_features) in enumerate([(32, 32), (16, 32)]):
        prefix = f"base_model.model.model.layers.0.{'self_attn.q_proj' if i == 0 else 'mlp.experts.1.gate_proj'}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(2, in_features, generator=generator).to(torch.bfloat16)
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, 2, generator=generator)
    return tensors


def _bodies() -> list[tuple[str, dict]]:
    async def go():
        engine = RecordingEngine()
        client = EngineClient(await engine.start(), kind="sglang", backoff_s=0.01)
        await client.load_lora_adapter("a", "/adapters/a", pinned=True)
        await client.load_lora_adapter_from_tensors("b", CONFIG, _tensors(), tp_size=2)
        await client.load_lora_adapter_from_tensors("c", CONFIG, _tensors().items(), load_format=None, verify=False)
        await client.unload_lora_adapter("a")
        await client.close()
        await engine.runner.cleanup()
        return engine.bodies

    return asyncio.run(go())


def _decode_with_sglang(body: dict, tp_size: int) -> list:
    """Oracle process: SGLang's parse and normalisation, then each rank's own decoding
    (`BaseTpWorker.load_lora_adapter_from_tensors`); per rank {name: (dtype, shape, sha256)} or the error."""
    import types

    import pydantic
    from sglang.srt.managers import io_struct
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from moe_rl.engine.lora_tensors import tensor_sha256

    req = pydantic.TypeAdapter(io_struct.LoadLoRAAdapterFromTensorsReqInput).validate_python(body)
    req.serialized_named_tensors = normalize_serialized_named_tensor_payloads(req.serialized_named_tensors)
    req.lora_id = "0" * 32  # the tokenizer manager's LoRARef id
    out = []
    for tp_rank in range(tp_size):
        seen = {}
        names = dict(
            torch=torch,
            MultiprocessingSerializer=MultiprocessingSerializer,
            logger=__import__("logging").getLogger("oracle"),
            FlattenedTensorBucket=FlattenedTensorBucket,
            monkey_patch_torch_reductions=monkey_patch_torch_reductions,
            get_parallel=lambda: types.SimpleNamespace(tp_rank=tp_rank),
        )
        worker = types.SimpleNamespace(
            model_runner=types.SimpleNamespace(
                load_lora_adapter_from_tensors=lambda ref, tensors, config, added: seen.update(tensors) or "loaded"
            )
        )
        worker.deserialize_own_rank = types.MethodType(
            sglang_oracle.extract("sglang.srt.managers.tp_worker", "BaseTpWorker.deserialize_own_rank", names), worker
        )
        load = sglang_oracle.extract(
            "sglang.srt.managers.tp_worker", "BaseTpWorker.load_lora_adapter_from_tensors", names
        )
        try:
            load(worker, req)
            out.append({n: (str(t.dtype), list(t.shape), tensor_sha256(t)) for n, t in seen.items()})
        except Exception as error:  # noqa: BLE001 - reported to the test
            out.append(f"{type(error).__name__}: {error}")
    return out


def test_client_lora_bodies_are_sglang_requests():
    bodies = _bodies()
    assert [p for p, _ in bodies] == [
        "/load_lora_adapter",
        "/load_lora_adapter_from_tensors",
        "/load_lora_adapter_from_tensors",
        "/unload_lora_adapter",
    ]
    assert sglang_oracle.call(_check_with_sglang, bodies, REQUEST_CLASSES, VOCAB) == []
    flattened, plain = bodies[1][1], bodies[2][1]
    assert flattened["load_format"] == "flattened_bucket" and len(flattened["serialized_named_tensors"]) == 2
    assert plain["load_format"] is None and "expected_checksums" not in plain


def _megatrons_storage_loader(data: bytes):
    """What megatron-core 0.19 puts in `torch.storage._load_from_bytes` when it is imported."""
    return torch.load(io.BytesIO(data), weights_only=True)


_megatrons_storage_loader.__module__, _megatrons_storage_loader.__qualname__ = (
    "megatron.core.safe_globals",
    "safe_load_from_bytes",
)


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
@pytest.mark.parametrize("storage_loader", ["torch", "megatron_patched"])
def test_tensor_payload_decodes_with_sglangs_code_to_the_exact_tensors(load_format, storage_loader, monkeypatch):
    """Also from a process where megatron-core replaced torch's storage loader (a trainer on 0.19):
    SGLang's unpickler refuses megatron's name, so the payload must carry torch's."""
    tensors = _tensors()
    if storage_loader == "megatron_patched":
        monkeypatch.setattr(torch.storage, "_load_from_bytes", _megatrons_storage_loader)
    body = LoraTensorsBody.build("b", CONFIG, tensors, tp_size=2, load_format=load_format).to_json()
    monkeypatch.undo()
    want = {n: (str(t.dtype), list(t.shape), tensor_sha256(t)) for n, t in tensors.items()}
    assert sglang_oracle.call(_decode_with_sglang, body, 2) == [want, want]
    wrong = {**body, "expected_checksums": {**body["expected_checksums"], next(iter(tensors)): "0" * 64}}
    for result in sglang_oracle.call(_decode_with_sglang, wrong, 2):  # SGLang's own check refuses it
        assert isinstance(result, str) and "[LORA-CHECK]" in result and "1 value-diff" in result


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sglang_lora_twin")
    config = hf_config(QWEN3_MOE_SMALL, vocab_size=64, num_hidden_layers=1, norm_topk_prob=False)
    save_random_model(config, path, seed=0)
    return str(path)


@pytest.mark.timeout(600)
def test_twin_takes_the_clients_lora_loads_and_unloads(model_dir, tmp_path):
    tensors = _tensors()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(__import__("json").dumps(CONFIG))
    want = {n: tensor_sha256(t) for n, t in sorted(tensors.items())}
    with SGLangTwin(model_dir, tp_size=2) as twin:

        async def go():
            client = EngineClient(twin.url, kind="sglang", retries=0, timeout_s=60)
            try:
                assert await client.load_lora_adapter_from_tensors("mem", CONFIG, tensors, tp_size=2) == {
                    "mem": "__tensor__"
                }
                assert (await client.load_lora_adapter("disk", str(tmp_path)))["disk"] == str(tmp_path)
                with pytest.raises(
                    EngineError, match="HTTP 400.*Failed to load LoRA adapter mem because it is already loaded"
                ):
                    await client.load_lora_adapter_from_tensors("mem", CONFIG, tensors, tp_size=2)
                state = twin.get("/twin/lora")
                assert await client.unload_lora_adapter("disk") == {"mem": "__tensor__"}
                with pytest.raises(EngineError, match="HTTP 400.*does not exist"):
                    await client.unload_lora_adapter("disk")
                return state, twin.get("/twin/lora")
            finally:
                await client.close()

        loaded, after = asyncio.run(go())
    assert loaded["registered"] == ["disk", "mem"]
    for rank in loaded["ranks"]:
        assert rank == {
            "mem": {"path": "__tensor__", "tensors": want},
            "disk": {"path": str(tmp_path), "tensors": want},
        }
    assert after["registered"] == ["mem"] and all(list(rank) == ["mem"] for rank in after["ranks"])


def _published(version: int) -> dict[str, torch.Tensor]:
    return {name: tensor.float() + version for name, tensor in _tensors().items()}


@pytest.mark.timeout(600)
def test_adapter_sync_against_the_twin(model_dir, tmp_path):
    """sync.lora.AdapterSync on the twin (tp 2), both routes: each version lands on every TP rank
    with its exact tensors, older ones are unloaded down to `keep`, disk files go only after."""
    import time

    from parallel.peft import write_adapter
    from sync.config import AdapterSyncConfig
    from sync.lora import AdapterSync, adapter_name

    with SGLangTwin(model_dir, tp_size=2) as twin:
        syncs = {
            route: AdapterSync(
                [EngineClient(twin.url, kind="sglang", name="twin", timeout_s=60)],
                AdapterSyncConfig(route=route, directory=str(tmp_path), keep=2),
                write_adapter,
            )
            for route in ("tensors", "disk")
        }
        try:
            for route, first in (("tensors", 0), ("disk", 10)):
                for version in range(first, first + 3):
                    syncs[route].publish(version, CONFIG, _published(version))
            expected = {adapter_name(v) for v in (1, 2, 11, 12)}
            deadline = time.monotonic() + 120
            while set(twin.get("/twin/lora")["registered"]) != expected and time.monotonic() < deadline:
                time.sleep(0.2)  # the unloads of v0 and v10 run in the background
            state = twin.get("/twin/lora")
        finally:
            for sync in syncs.values():
                sync.close()
    assert set(state["registered"]) == expected
    for rank in state["ranks"]:
        assert set(rank) == expected
        for version in (1, 2, 11, 12):
            want = {n: tensor_sha256(t) for n, t in sorted(_published(version).items())}
            assert rank[adapter_name(version)]["tensors"] == want
    assert (tmp_path / adapter_name(12)).is_dir() and (tmp_path / adapter_name(11)).is_dir()
