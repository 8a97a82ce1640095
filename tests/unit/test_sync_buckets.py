"""Flat buckets: round trip, SGLang-compatible layout, bucket sizing, bad input."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.sync.buckets import (Bucket, bucketize, empty_like_manifest, flatten, plan_buckets,
                                      unflatten)


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(7, 5, generator=g)),
            ("b.bias", torch.randn(3, generator=g).to(torch.bfloat16)),
            ("c.weight", torch.randn(4, 4, generator=g).to(torch.bfloat16)),
            ("d.scale", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
            ("e.weight", torch.randn(2, 3, generator=g).t())]  # last one non-contiguous]


def test_round_trip_is_bit_exact_and_contiguous_views():
    named = [("x", torch.randn(3, 4)), ("y", torch.randn(6).to(torch.bfloat16)), ("z", torch.randn(2, 2).t())]
    b = flatten(named)
    assert b.flat.dtype == torch.uint8 and b.nbytes == 12 * 4 + 6 * 2 + 4 * 4
    out = unflatten(b)
    for (n0, t0), (n1, t1) in zip(named, out):
        assert n0 == n1 and t1.dtype == t0.dtype and t1.shape == t0.shape
        assert torch.equal(t1, t0)


def test_layout_matches_sglang_receiver():
    """The receiver allocates from the manifest alone: our bytes must land where it reads them."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    for group in plan_buckets(_tensors(), bucket_bytes=1 << 20):
        b = flatten(group)
        m = b.manifest()
        recv = FlattenedTensorBucket.empty(m["names"], m["dtypes"], m["shapes"], "cpu")
        recv.get_flattened_tensor().copy_(b.flat)  # what the broadcast does
        for (n0, t0), (n1, t1) in zip(group, recv.reconstruct_tensors()):
            assert n0 == n1 and torch.equal(t0.contiguous(), t1)


def test_empty_like_manifest_receives():
    b = flatten([("p", torch.randn(4, 3)), ("q", torch.randn(6))])
    r = empty_like_manifest(b.metas)
    r.flat.copy_(b.flat)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(unflatten(b), unflatten(r)))


def test_plan_respects_budget_and_keeps_order():
    named = [(f"t{i}", torch.zeros(100)) for i in range(10)]  # 400 bytes each
    groups = list(plan_buckets(named, bucket_bytes=1000))
    assert [len(g) for g in groups] == [2, 2, 2, 2, 2]
    assert [n for g in groups for n, _ in g] == [n for n, _ in named]
    # a tensor above the budget travels alone
    big = [("s", torch.zeros(10)), ("big", torch.zeros(1000)), ("s2", torch.zeros(10))]
    assert [[n for n, _ in g] for g in plan_buckets(big, 100)] == [["s"], ["big"], ["s2"]]


def test_misaligned_dtype_starts_new_bucket():
    named = [("h", torch.zeros(3, dtype=torch.bfloat16)), ("f", torch.zeros(2, dtype=torch.float32))]
    groups = list(plan_buckets(named, bucket_bytes=1 << 20))  # 6 bytes then a 4-byte dtype
    assert [[n for n, _ in g] for g in groups] == [["h"], ["f"]]
    with pytest.raises(ValueError, match="multiple"):
        flatten(named)
    for b in bucketize(named, 1 << 20):
        for m in b.metas:
            assert m.offset % m.torch_dtype.itemsize == 0


def test_streaming_consumes_lazily():
    pulled = []

    def gen():
        for i in range(6):
            pulled.append(i)
            yield f"t{i}", torch.zeros(100)

    it = bucketize(gen(), bucket_bytes=800)
    first = next(it)
    assert first.names == ["t0", "t1"] and pulled == [0, 1, 2]  # only one bucket ahead


def test_bad_input():
    with pytest.raises(ValueError):
        flatten([])
    with pytest.raises(ValueError, match="duplicate"):
        flatten([("a", torch.zeros(1)), ("a", torch.zeros(1))])
    with pytest.raises(TypeError):
        flatten([("a", [1.0, 2.0])])
    with pytest.raises(ValueError):
        list(plan_buckets([("a", torch.zeros(1))], 0))
    with pytest.raises(ValueError):
        unflatten(Bucket(torch.zeros(4, dtype=torch.uint8), flatten([("a", torch.zeros(2))]).metas))


def test_ramp_doubles_the_cap_from_the_first_bucket():
    named = [(f"t{i}", torch.zeros(25)) for i in range(40)]  # 100 bytes each
    sizes = [sum(t.numel() * 4 for _, t in g) for g in plan_buckets(named, 1000, first_bucket_bytes=200)]
    assert sizes == [200, 400, 800, 1000, 1000, 600]
    assert sum(sizes) == 4000
    assert [n for g in plan_buckets(named, 1000, 200) for n, _ in g] == [n for n, _ in named]
    with pytest.raises(ValueError):
        list(plan_buckets(named, 1000, first_bucket_bytes=0))
