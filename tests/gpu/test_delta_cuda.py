"""The delta sync's compare on CUDA (`sync.delta.KeptCopy` on device tensors): payloads byte-equal
to the host codec's (SUM64, `hash_kind`), a chain applied on the host bit-equal, the kept copy
following from the payloads without a host copy of a weight; the encode's GB/s (`delta_encode_gb_per_s`,
which `moe-rl plan` takes). Under 2 GB of GPU memory, seconds."""

from __future__ import annotations

import time

import pytest
import torch

from sync.delta import SUM64, AppliedCopy, KeptCopy, apply, bits, encode, header
from tests.gpu.metrics import record
from tests.gpu.test_export_fp8_cuda import HostAllocations

pytestmark = pytest.mark.gpu


def drift(weights: dict[str, torch.Tensor], fraction: float, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Each tensor with `fraction` of its elements given other bits (an RL step, as the engine sees it)."""
    out = {}
    for name, tensor in weights.items():
        new = tensor.clone()
        flat = bits(new)
        count = max(1, int(fraction * flat.numel()))
        at = torch.randint(0, flat.numel(), (count,), generator=gen).to(flat.device)
        flat[at] ^= 1
        out[name] = new
    return out


def test_a_chain_encoded_on_cuda_equals_the_host_codec_and_applies_bit_equal():
    gen = torch.Generator().manual_seed(0)
    weights = {
        "w": torch.randn(1024, 512, generator=gen).to(torch.bfloat16).cuda(),
        "q": torch.randn(256, 256, generator=gen).to(torch.float8_e4m3fn).cuda(),
        "scale": torch.rand(2, 2, generator=gen).cuda(),
    }
    kept, engine = KeptCopy(), AppliedCopy()
    anchor = dict(kept.encode_stream(weights.items(), 0, full=True))
    engine.hold({name: t.cpu() for name, t in anchor.items()}, 0)
    for version in range(1, 11):
        new = drift(weights, 0.01, gen)
        watch = HostAllocations()
        with watch:
            payloads = dict(kept.encode_stream(new.items(), version, full=False))
        assert all(p.is_cuda for p in payloads.values())
        assert watch.largest < max(p.numel() for p in payloads.values()) + 1024, "a host copy of a weight"
        for name, payload in payloads.items():
            expected = encode(new[name].cpu(), weights[name].cpu(), version - 1, version, hash_kind=SUM64)
            assert header(payload).hash_kind == SUM64
            assert torch.equal(payload.cpu(), expected)
        assert engine.apply_stream(((n, p.cpu()) for n, p in payloads.items()), version - 1) == version
        for name, payload in payloads.items():  # decoded and written on the GPU, as SGLang's ranks do
            target = weights[name].clone()
            assert apply(payload, target, version - 1) == version
            assert torch.equal(bits(target), bits(new[name]))
        weights = new
    for name, tensor in weights.items():
        assert torch.equal(bits(engine.tensors[name]), bits(tensor.cpu()))
        assert torch.equal(bits(kept.tensors[name]), bits(tensor.cpu()))


def test_the_encode_rate_on_cuda():
    """A 1 GiB bf16 tensor at 1% changed: the kept copy up over PCIe, the compare and the payload on
    the GPU, the changed elements back into the kept copy."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    weight = torch.randn(1 << 29, device="cuda", generator=gen).to(torch.bfloat16)
    kept = KeptCopy()
    list(kept.encode_stream([("w", weight)], 0, full=True))
    seconds = []
    for version in range(1, 4):
        flat = bits(weight)
        at = torch.randint(0, flat.numel(), (flat.numel() // 100,), device="cuda", generator=gen)
        flat[at] ^= 1
        torch.cuda.synchronize()
        start = time.perf_counter()
        list(kept.encode_stream([("w", weight)], version, full=False))
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    assert torch.equal(bits(kept.tensors["w"]), bits(weight.cpu()))
    record("delta_encode_gb_per_s", weight.nbytes / min(seconds[1:]) / 1e9, "GB/s of bf16, 1% changed, one GPU")
