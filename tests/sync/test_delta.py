"""Delta codec (`sync.delta`): exact bitwise round trips per encoding and dtype, the gap escape, the
choice "auto" makes, refusals before writing, hash checks, idempotent retries, long chains, and
both ends' copies."""

from __future__ import annotations

import math

import pytest
import torch

import sync.delta
from sync.delta import (
    CRC32,
    ESCAPE,
    HEADER_NBYTES,
    SUM64,
    AppliedCopy,
    DeltaError,
    KeptCopy,
    apply,
    digest,
    encode,
    header,
    payload_nbytes,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8]
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(BITS[tensor.element_size()])


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def random_tensor(dtype: torch.dtype, shape, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
    return (torch.randn(shape, generator=gen) * 3).to(dtype)


def changed(old: torch.Tensor, positions, gen: torch.Generator) -> torch.Tensor:
    """`old` with the elements at `positions` (flat) given other bits."""
    new = old.clone()
    flat = bits(new).view(-1)
    flat[positions] = flat[positions] ^ torch.randint(1, 100, (len(positions),), generator=gen).to(flat.dtype)
    return new


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("encoding", ["auto", "gaps", "bitmap", "dense"])
def test_round_trip_every_encoding_and_dtype(dtype, encoding):
    gen = torch.Generator().manual_seed(0)
    old = random_tensor(dtype, (37, 19), gen)
    new = changed(old, torch.randperm(old.numel(), generator=gen)[:20], gen)
    payload = encode(new, old, base_version=4, version=5, encoding=encoding)
    head = header(payload)
    assert head.encoding == (encoding if encoding != "auto" else head.encoding)
    assert (head.count, head.base_version, head.version, head.shape) == (20, 4, 5, (37, 19))
    target = old.clone()
    assert apply(payload, target, base_version=4) == 5
    assert_bit_equal(target, new)


def test_fp8_weight_and_float32_scales_round_trip():
    gen = torch.Generator().manual_seed(1)
    weight = random_tensor(torch.float8_e4m3fn, (64, 64), gen)
    scales = torch.rand(2, 2, generator=gen)
    for old, new in ((weight, changed(weight, [0, 4095], gen)), (scales, changed(scales, [3], gen))):
        target = old.clone()
        apply(encode(new, old, 0, 1), target, 0)
        assert_bit_equal(target, new)


@pytest.mark.parametrize("positions", [[0], [70000], [0, 65535, 65536, 65536 + 2 * ESCAPE + 1], [200_000 - 1]])
def test_gaps_past_65535_use_the_escape_and_the_ends_round_trip(positions):
    gen = torch.Generator().manual_seed(2)
    old = random_tensor(torch.bfloat16, (200_000,), gen)
    new = changed(old, positions, gen)
    payload = encode(new, old, 0, 1, encoding="gaps")
    escapes, previous = 0, -1
    for p in positions:
        escapes += (p - previous - 1) // ESCAPE
        previous = p
    assert header(payload).tokens == len(positions) + escapes
    target = old.clone()
    apply(payload, target, 0)
    assert_bit_equal(target, new)


def test_no_change_sends_the_header_alone_and_verifies():
    old = torch.randn(100).to(torch.bfloat16)
    for encoding in ("auto", "gaps", "bitmap", "dense"):
        payload = encode(old.clone(), old, 7, 8, encoding)
        head = header(payload)
        assert (head.encoding, head.count, payload.numel()) == ("none", 0, HEADER_NBYTES + 8)
        assert apply(payload, old.clone(), 7) == 8
    drifted = changed(old, [3], torch.Generator().manual_seed(0))
    with pytest.raises(DeltaError, match="hash mismatch"):
        apply(encode(old.clone(), old, 7, 8), drifted, 7)


def test_all_changed_goes_dense_and_auto_picks_the_smallest():
    gen = torch.Generator().manual_seed(3)
    old = random_tensor(torch.bfloat16, (4096,), gen)
    assert header(encode(changed(old, list(range(4096)), gen), old, 0, 1)).encoding == "dense"
    shape, size = (4096,), 2
    for count in (1, 50, 300, 600, 1200, 2000, 3000, 4096):
        new = changed(old, torch.randperm(4096, generator=gen)[:count], gen)
        sizes = {e: payload_nbytes(e, shape, size, count, count) for e in ("gaps", "bitmap", "dense")}
        payload = encode(new, old, 0, 1)
        assert payload.numel() == min(sizes.values())
        assert sizes[header(payload).encoding] == min(sizes.values())
    assert payload_nbytes("bitmap", shape, size, 10, 0) == HEADER_NBYTES + 8 + 4096 // 8 + 10 * size
    assert payload_nbytes("gaps", shape, size, 10, 13) == HEADER_NBYTES + 8 + math.ceil(26 / 8) * 8 + 10 * size


def test_nan_and_negative_zero_bit_patterns_round_trip():
    old = torch.zeros(8, dtype=torch.float32)
    new = old.clone()
    bits(new)[:] = torch.tensor(
        [0x7FC00000, 0x7FC00001, 0xFFC00123 - (1 << 32), 0x7F800001, -(1 << 31), 0, 0x7F800000, 1], dtype=torch.int32
    )  # quiet NaN, NaN payloads, signalling NaN, -0.0, +0.0, inf, the smallest subnormal
    for encoding in ("gaps", "bitmap", "dense"):
        target = old.clone()
        apply(encode(new, old, 0, 1, encoding), target, 0)
        assert_bit_equal(target, new)
    payload = encode(old.clone(), new, 0, 1)  # NaN -> NaN with the same bits is unchanged
    assert header(payload).count == 7


def test_refusals_leave_the_target_untouched():
    gen = torch.Generator().manual_seed(4)
    old = random_tensor(torch.bfloat16, (64,), gen)
    payload = encode(changed(old, [1, 2], gen), old, 3, 4)
    target = old.clone()
    with pytest.raises(DeltaError, match="applies on version 3"):
        apply(payload, target, base_version=2)
    with pytest.raises(DeltaError, match="65 elements"):
        apply(payload, torch.zeros(65, dtype=torch.bfloat16), 3)
    with pytest.raises(DeltaError, match="4-byte"):
        apply(payload, torch.zeros(64, dtype=torch.float32), 3)
    with pytest.raises(DeltaError, match="bytes, its header"):
        apply(payload[:-1].clone(), target, 3)
    assert_bit_equal(target, old)
    with pytest.raises(ValueError, match="old="):
        encode(old, old.float(), 0, 1)


def test_a_corrupted_value_fails_the_hash():
    gen = torch.Generator().manual_seed(5)
    old = random_tensor(torch.bfloat16, (1000,), gen)
    payload = encode(changed(old, [10, 500], gen), old, 0, 1, "gaps")
    payload[-1] ^= 0x10
    with pytest.raises(DeltaError, match="hash mismatch"):
        apply(payload, old.clone(), 0)


def test_sum64_is_its_definition_in_any_chunking(monkeypatch):
    """SUM64 = sum of element_i x (i x step + 1) mod 2**64 (`sync.delta.digest`), here against Python
    integers, with torch's int64 products and sums wrapping, over chunks of 7 and of the default."""
    gen = torch.Generator().manual_seed(10)
    step = sync.delta._SUM64_STEP
    cases = [
        torch.randint(-(1 << 15), 1 << 15, (50,), generator=gen, dtype=torch.int16),
        torch.randint(0, 256, (23,), generator=gen, dtype=torch.uint8),
        torch.tensor([-(1 << 63), (1 << 63) - 1, -1, 0, 1 << 62], dtype=torch.int64),  # products wrap
        torch.randint(-(1 << 31), (1 << 31) - 1, (29,), generator=gen, dtype=torch.int32),
    ]
    for elements in cases:
        expected = sum(int(v) * (i * step + 1) for i, v in enumerate(elements.tolist())) % (1 << 64)
        assert digest(elements, SUM64) == expected
        monkeypatch.setattr(sync.delta, "SUM64_CHUNK", 7)
        assert digest(elements, SUM64) == expected
        monkeypatch.undo()


@pytest.mark.parametrize("encoding", ["gaps", "bitmap"])
def test_a_sum64_payload_applies_and_catches_a_changed_or_swapped_element(encoding):
    """What a device sender sends (SUM64, `encode` on a GPU tensor): the same body as CRC32's, its
    hash checked after applying; one changed element or two swapped ones (a reordered write) fail."""
    gen = torch.Generator().manual_seed(11)
    old = random_tensor(torch.bfloat16, (3000,), gen)
    new = changed(old, 100 + torch.randperm(2900, generator=gen)[:30], gen)  # elements 0-99 stay
    payload = encode(new, old, 0, 1, encoding, hash_kind=SUM64)
    crc = encode(new, old, 0, 1, encoding)
    assert (header(payload).hash_kind, header(crc).hash_kind) == (SUM64, CRC32)
    assert torch.equal(payload[HEADER_NBYTES:], crc[HEADER_NBYTES:])  # the body is the same
    target = old.clone()
    assert apply(payload, target, 0) == 1
    assert_bit_equal(target, new)
    flat = bits(old).view(-1)
    swapped = old.clone()
    bits(swapped).view(-1)[[7, 8]] = flat[[8, 7]]
    for base in (changed(old, [5], gen), swapped):  # not the base: elements it keeps come out wrong
        with pytest.raises(DeltaError, match="hash mismatch"):
            apply(payload, base, 0)


def test_applying_twice_gives_the_same_result():
    gen = torch.Generator().manual_seed(6)
    old = random_tensor(torch.bfloat16, (5000,), gen)
    new = changed(old, torch.randperm(5000, generator=gen)[:40], gen)
    for encoding in ("gaps", "bitmap", "dense"):
        payload, target = encode(new, old, 0, 1, encoding), old.clone()
        apply(payload, target, 0)
        apply(payload, target, 0)  # a retry of the same update
        assert_bit_equal(target, new)


def test_a_100_step_chain_equals_the_final_tensor():
    gen = torch.Generator().manual_seed(7)
    current = random_tensor(torch.bfloat16, (300, 100), gen)
    target = current.clone()
    for version in range(100):
        count = int(torch.randint(0, 3000, (1,), generator=gen))
        new = changed(current, torch.randperm(current.numel(), generator=gen)[:count], gen)
        assert apply(encode(new, current, version, version + 1), target, version) == version + 1
        current = new
    assert_bit_equal(target, current)


def named_export(step: int, gen: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    base = torch.Generator().manual_seed(0)
    weight = (torch.randn(256, 64, generator=base) + 1e-3 * step).to(torch.bfloat16)
    scales = torch.rand(4, generator=base) + step
    return [("w", weight), ("s", scales), ("n", random_tensor(torch.int8, (9,), gen))]


def test_kept_and_applied_copies_follow_a_chain():
    gen = torch.Generator().manual_seed(8)
    kept, engine = KeptCopy(), AppliedCopy()
    with pytest.raises(RuntimeError, match="full anchor"):
        next(kept.encode_stream(named_export(0, gen), 0, full=False))
    engine.hold(dict(kept.encode_stream(named_export(0, gen), 0, full=True)), 0)
    assert kept.version == 0 and kept.stats.anchor and kept.nbytes == 256 * 64 * 2 + 4 * 4 + 9
    for version in range(1, 6):
        export = named_export(version, gen)
        if version >= 3:  # never sent before version 3: dense inside that delta, then a delta like the rest
            export.append(("new", torch.arange(5.0) + (version == 5)))
        assert engine.apply_stream(kept.encode_stream(export, version, full=False), version - 1) == version
        stats = kept.stats
        assert stats.wire_bytes < stats.dense_bytes and 0 < stats.changed_fraction < 1
    for name, tensor in export:
        assert_bit_equal(engine.tensors[name], tensor)

    stream = kept.encode_stream(named_export(6, gen), 6, full=False)
    next(stream)  # the send fails halfway: the kept copy no longer names a version
    assert kept.version is None
    with pytest.raises(RuntimeError, match="full anchor"):
        next(kept.encode_stream(named_export(7, gen), 7, full=False))


def test_applied_copy_refuses_a_faulty_version_whole_and_keeps_what_it_held():
    gen = torch.Generator().manual_seed(9)
    kept, engine = KeptCopy(), AppliedCopy()
    with pytest.raises(DeltaError, match="holds no anchor"):
        engine.stage("w", encode(torch.zeros(3), torch.ones(3), 0, 1))
    engine.hold(dict(kept.encode_stream(named_export(0, gen), 0, full=True)), 0)
    held = {name: tensor.clone() for name, tensor in engine.tensors.items()}
    v1 = list(kept.encode_stream(named_export(1, gen), 1, full=False))
    v2 = list(kept.encode_stream(named_export(2, gen), 2, full=False))
    corrupt = [(name, p.clone()) for name, p in v1]
    corrupt[0][1][-1] ^= 1  # the last value byte of "w": its hash fails after applying
    faults = {
        "applies on version 1": v2,  # a later version's buckets first (reordered across versions)
        "lost bucket": v1[1:],
        "duplicated bucket": v1 + v1[:1],
        "hash mismatch": corrupt,
        "produce versions": [v1[0], *[(n, encode(engine.tensors[n], engine.tensors[n], 0, 9)) for n, _ in v1[1:]]],
    }
    for match, payloads in faults.items():
        with pytest.raises(DeltaError, match=match):
            engine.apply_stream(payloads, base_version=0)
        assert engine.version == 0  # nothing half-applied: the held copy is the anchor's, bit for bit
        for name, tensor in held.items():
            assert_bit_equal(engine.tensors[name], tensor)
    with pytest.raises(DeltaError, match="the copy holds 0"):
        engine.apply_stream(v2, base_version=1)
    assert engine.apply_stream(v1, 0) == 1 and engine.apply_stream(v2, 1) == 2
    for name, tensor in kept.tensors.items():  # what the sender sent last, bit for bit
        assert_bit_equal(engine.tensors[name], tensor)
