"""Delta sync into SGLang (`moe_rl.engine.sglang_delta`) against SGLang 0.5.23's own code: its real
Qwen3-MoE model class (fused qkv and gate_up, stacked experts, TP slices) built on its CPU backend,
loaded by its own `load_weights`, and every update dispatched by SGLang's model-runner
`WeightUpdater.update_weights_from_tensor` to the custom loader registered under its import path.

Each TP rank (TP 1, TP 2, and TP 2 with EP 2: SGLang's groups on gloo) holds two SGLang models: the engine, which
only ever gets payloads, and a reference that `load_weights` loads with each version's whole
tensors. After every committed version the two must be equal bit for bit; a refused update must
leave the engine as it was and answer the sender with the reason on its next call."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest

from sync.delta import SGLANG_LOADER
from tests.tiny_models import hf_config, save_random_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.world]


def _rank(rank: int, tp: int, ep: int, port: int, model_dir: str, results) -> None:
    try:
        results.put((rank, _scenario(rank, tp, ep, port, model_dir)))
    except BaseException as error:  # the parent reports it
        import traceback

        results.put((rank, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def _scenario(rank: int, tp: int, ep: int, port: int, model_dir: str) -> dict:
    from tests.conformance import sglang_oracle

    sglang_oracle.install(models=True)
    import torch
    import transformers
    from safetensors.torch import load_file
    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.common import build_server_info

    from sync.bucket import BucketPacker
    from sync.delta import SGLANG_COMMIT, SUM64, encode
    from sync.transports.cuda_ipc import loader_payloads

    torch.set_num_threads(1)
    server_args = ServerArgs(
        model_path=model_dir,
        tp_size=tp,
        ep_size=ep,
        device="cpu",
        skip_tokenizer_init=True,
        custom_weight_loader=[SGLANG_LOADER],
    )
    runtime_context.publish(server_args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=rank))
    parallel_state.init_distributed_environment(
        world_size=tp, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=rank, backend="gloo"
    )
    parallel_state.initialize_model_parallel(backend="gloo")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    hf = load_file(f"{model_dir}/model.safetensors")  # the checkpoint's names: one tensor per expert
    hf["mtp.fc.weight"] = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    # (a tensor the main model's load_weights skips: SGLang's draft model loads it)
    torch.set_default_dtype(torch.bfloat16)  # what SGLang serves this checkpoint in
    engine, reference = Qwen3MoeForCausalLM(config), Qwen3MoeForCausalLM(config)
    updater = WeightUpdater(
        tp_rank=rank,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders=[SGLANG_LOADER],  # --custom-weight-loader
        get_model=lambda: engine,
        update_model_fields=lambda *a, **k: None,
        recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: None,
    )
    names = sorted(hf)
    packer = BucketPacker(32 << 10)

    def send(named: dict, version: int, delta: bool, only: list[str] = names) -> tuple[bool, str]:
        """The cuda_ipc transport's hand-over, on the host: buckets packed from the stream, each as
        `loader_payloads` makes it, through SGLang's dispatch; the first failure, else the last answer."""
        for bucket in packer.pack((n, named[n]) for n in only):
            ok, message = updater.update_weights_from_tensor(loader_payloads(bucket, version, delta), SGLANG_LOADER)
            if not ok:
                return ok, message
        return ok, message

    def commit(version: int) -> tuple[bool, str]:
        """The commit, then an empty call that carries any refusal back (the sender's protocol)."""
        first = updater.update_weights_from_tensor([(SGLANG_COMMIT, torch.tensor([version]))], SGLANG_LOADER)
        if not first[0]:
            return first
        return updater.update_weights_from_tensor([], SGLANG_LOADER)

    def equal_to_reference(tensors: dict) -> bool:
        reference.load_weights(list(tensors.items()))
        ref = dict(reference.named_parameters())
        return all(torch.equal(p.view(torch.int16), ref[n].view(torch.int16)) for n, p in engine.named_parameters())

    def step(old: dict, version: int, fraction: float) -> dict:
        gen = torch.Generator().manual_seed(version)
        new = {}
        for n, t in old.items():
            changed = torch.rand(t.shape, generator=gen) < fraction
            new[n] = torch.where(changed, t + 0.01 * torch.randn(t.shape, generator=gen).to(t.dtype), t)
        return new

    out: dict = {"chain": [], "server_info": build_server_info(server_args, {})["custom_weight_loader"]}
    out["anchor_sends"] = send(hf, 1, delta=False)
    out["anchor_commit"] = commit(1)
    out["anchor_equal"] = equal_to_reference(hf)
    placements = engine._moe_rl_delta.placements
    q = "model.layers.0.self_attn.q_proj.weight"
    o = "model.layers.0.self_attn.o_proj.weight"
    e = "model.layers.0.mlp.experts.0.gate_proj.weight"
    out["held"] = {n: sum(int(r.length.sum()) for r in placements[n].held) for n in (q, o, e)}
    out["served"] = {n: placements[n].served for n in ("mtp.fc.weight", "model.norm.weight")}
    out["runs"] = {n: sum(r.length.numel() for r in placements[n].held) for n in (q, o)}
    current, version = hf, 1
    for version in range(2, 7):  # five chained deltas, ~2% of the elements each
        new = step(current, version, 0.02)
        payloads = {n: encode(new[n], current[n], version - 1, version, hash_kind=SUM64) for n in names}
        out["chain"].append((send(payloads, version, delta=True), commit(version), equal_to_reference(new)))
        current = new
    # a wrong base (4, the engine holds 6): refused on the next call, nothing written
    stale = {n: encode(step(current, 7, 0.02)[n], current[n], 4, 7, hash_kind=SUM64) for n in names}
    out["wrong_base"] = (send(stale, 7, True, names[:10]), commit(7), equal_to_reference(current))
    # a corrupted value: the hash after applying fails on the TP group's sum; the tensors need an anchor
    new = step(current, 8, 0.02)
    payloads = {n: encode(new[n], current[n], 6, 8, hash_kind=SUM64) for n in names}
    broken = payloads[q].clone()
    broken[-1] ^= 1  # the last value's low byte
    payloads[q] = broken
    sent = send(payloads, 8, delta=True)  # a bucket's refusal answers the next call, or the commit's
    out["corrupt"] = sent if not sent[0] else commit(8)
    retry = {n: encode(new[n], current[n], 8, 9, hash_kind=SUM64) for n in names}
    sent = send(retry, 9, delta=True)
    out["after_corrupt"] = sent if not sent[0] else commit(9)
    # a lost bucket: the commit finds tensors at an older version
    out["heal"] = (send(current, 10, delta=False), commit(10), equal_to_reference(current))
    new = step(current, 11, 0.02)
    payloads = {n: encode(new[n], current[n], 10, 11, hash_kind=SUM64) for n in names}
    out["lost_bucket"] = (send(payloads, 11, True, names[: len(names) // 2]), commit(11))
    return out


def _run(tp: int, ep: int, model_dir: str) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, tp, ep, port, model_dir, results)) for r in range(tp)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=540) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    for r in range(tp):
        assert isinstance(got[r], dict), got[r]
    return [got[r] for r in range(tp)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sglang_delta")
    save_random_model(hf_config(vocab_size=64, max_position_embeddings=64), path, dtype=__import__("torch").bfloat16)
    return str(path)


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (2, 2)])
def test_deltas_apply_in_place_through_sglangs_custom_loader(tp, ep, model_dir):
    for rank, out in enumerate(_run(tp, ep, model_dir)):
        assert out["served"] == {"mtp.fc.weight": False, "model.norm.weight": True}
        assert out["server_info"] == [SGLANG_LOADER]  # what the cuda_ipc transport reads at open
        assert out["anchor_sends"][0] and out["anchor_commit"][0] and out["anchor_equal"], out
        # TP slices: q_proj (column parallel) one run; o_proj (row parallel) one run per row
        expert = 32 * 64 // tp if ep == 1 else (32 * 64 if rank == 0 else 0)  # EP: expert 0 on rank 0
        assert out["held"] == {
            "model.layers.0.self_attn.q_proj.weight": 64 * 64 // tp,
            "model.layers.0.self_attn.o_proj.weight": 64 * 64 // tp,
            "model.layers.0.mlp.experts.0.gate_proj.weight": expert,
        }
        assert out["runs"]["model.layers.0.self_attn.q_proj.weight"] == 1
        assert out["runs"]["model.layers.0.self_attn.o_proj.weight"] == (1 if tp == 1 else 64)
        success = (True, "Success")
        assert out["chain"] == [(success, success, True)] * 5
        _, (ok, message), unchanged = out["wrong_base"]  # answered at the next call at the latest
        assert not ok and "applies on version 4, this engine holds 6" in message and unchanged
        ok, message = out["corrupt"]
        assert not ok and "hash mismatch after applying" in message
        ok, message = out["after_corrupt"]
        assert not ok and "holds no version of it" in message
        assert out["heal"] == (success, success, True)
        sent, (ok, message) = out["lost_bucket"]
        assert sent == success and not ok and "not at version 11 (a lost bucket?)" in message
