"""Bucket pack/unpack: exact round trips for every dtype, the byte bound, alignment, checksums."""

from __future__ import annotations

import pytest
import torch

from sync.bucket import BucketPacker, checksum, dtype_from_name, layout, unpack

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def random_tensor(dtype, shape, gen):
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen) * 3
        return t.to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=gen).to(dtype)


def named(n=30, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3,), (5, 7), (2, 3, 4), (), (0, 4), (33,)]
    return [
        (f"t{i}.{DTYPES[i % len(DTYPES)]}", random_tensor(DTYPES[i % len(DTYPES)], shapes[i % len(shapes)], gen))
        for i in range(n)
    ]


def round_trip(tensors, bucket_bytes):
    got, buckets = [], []
    for bucket in BucketPacker(bucket_bytes, checksums=True).pack(iter(tensors)):
        meta = bucket.announcement()
        metas = layout(meta["names"], meta["dtypes"], meta["shapes"])
        received = bucket.data.clone()  # what a receiver gets
        assert checksum(received) == bucket.checksum
        got += [(n, t.clone()) for n, t in unpack(received, metas)]
        buckets.append((bucket.nbytes, len(bucket.metas)))
    return got, buckets


@pytest.mark.parametrize("bucket_bytes", [64, 1000, 1 << 20])
def test_round_trip_every_dtype_exact(bucket_bytes):
    tensors = named()
    got, buckets = round_trip(tensors, bucket_bytes)
    assert [n for n, _ in got] == [n for n, _ in tensors]
    for (_, want), (_, have) in zip(tensors, got):
        assert have.dtype == want.dtype and have.shape == want.shape
        assert torch.equal(have.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    for nbytes, count in buckets:  # over the bound only when a single tensor is
        assert nbytes <= bucket_bytes or count == 1


def test_large_tensor_gets_its_own_bucket_without_copy():
    big = torch.randn(100)  # 400 bytes
    buckets = list(BucketPacker(128).pack([("a", torch.ones(4)), ("big", big), ("b", torch.ones(4))]))
    assert [[m.name for m in b.metas] for b in buckets] == [["a"], ["big"], ["b"]]
    assert buckets[1].data.data_ptr() == big.data_ptr()


def test_unaligned_tensor_starts_a_new_bucket():
    tensors = [("odd", torch.ones(3, dtype=torch.bfloat16)), ("f32", torch.ones(2))]  # 6 bytes, then 4-byte items
    buckets = list(BucketPacker(1024).pack(tensors))
    assert [[m.name for m in b.metas] for b in buckets] == [["odd"], ["f32"]]


def test_checksum_detects_a_flipped_byte():
    data = torch.arange(256, dtype=torch.uint8)
    before = checksum(data)
    data[100] ^= 1
    assert checksum(data) != before


def test_bad_metadata_is_a_value_error():
    with pytest.raises(ValueError, match="dtypes"):
        layout(["w"], ["floaty"], [[2]])
    with pytest.raises(ValueError, match="equal"):
        layout(["w", "v"], ["float32"], [[2]])
    with pytest.raises(ValueError, match="negative"):
        layout(["w"], ["float32"], [[-1]])
    with pytest.raises(ValueError, match="bucket_bytes"):
        BucketPacker(0)
    assert dtype_from_name("torch.bfloat16") is torch.bfloat16
