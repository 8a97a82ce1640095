"""Flat weight buckets: named tensors -> one contiguous byte tensor + a manifest, and back.

The byte layout is the one SGLang's `load_format="flattened_bucket"` receiver allocates from the
(names, dtypes, shapes) it is given: every tensor's raw bytes back to back in manifest order, no
padding, each offset a multiple of its dtype's item size. So the manifest sent over HTTP fully
determines the layout, and one `broadcast` of the flat tensor moves the whole bucket.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives inside a bucket."""

    name: str
    dtype: str  # torch dtype name without the `torch.` prefix ("float32", "bfloat16")
    shape: tuple[int, ...]
    offset: int  # byte offset in the flat bucket
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass
class Bucket:
    """A flat uint8 tensor plus the manifest that cuts it back into named tensors."""

    flat: torch.Tensor  # 1-D uint8
    metas: list[TensorMeta]

    @property
    def nbytes(self) -> int:
        return int(self.flat.numel())

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]

    def manifest(self) -> dict[str, list]:
        """The fields SGLang's update_weights_from_distributed takes to allocate the same bucket."""
        return {"names": [m.name for m in self.metas], "dtypes": [m.dtype for m in self.metas],
                "shapes": [list(m.shape) for m in self.metas]}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_tensor(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor name must be a non-empty string, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"{name}: only dense (strided) tensors can be bucketed, got {tensor.layout}")


def layout(named: list[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    """The manifest of a bucket holding `named` back to back (checks names and dtype alignment)."""
    if not named:
        raise ValueError("cannot build an empty bucket")
    metas, offset = [], 0
    seen: set[str] = set()
    for name, t in named:
        _check_tensor(name, t)
        if name in seen:
            raise ValueError(f"duplicate tensor name in bucket: {name}")
        seen.add(name)
        item = t.element_size()
        if offset % item:
            raise ValueError(f"{name}: byte offset {offset} is not a multiple of {t.dtype} size {item}; "
                             "use plan_buckets, which starts a new bucket instead")
        nbytes = t.numel() * item
        metas.append(TensorMeta(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
        offset += nbytes
    return metas


def bucket_size(metas: list[TensorMeta]) -> int:
    return metas[-1].offset + metas[-1].nbytes


def as_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s own storage as a flat uint8 view when it is already laid out as the bucket wants it
    (contiguous), else None: such a tensor alone in a bucket is sent without any copy."""
    if not t.is_contiguous():
        return None
    return t.detach().reshape(-1).view(torch.uint8)


def write_into(named: list[tuple[str, torch.Tensor]], buf: torch.Tensor) -> Bucket:
    """Pack `named` into the front of the uint8 buffer `buf`: one copy per tensor, straight from
    its (possibly strided, possibly other-device) storage into its slot, none through a temporary."""
    metas = layout(named)
    size = bucket_size(metas)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < size:
        raise ValueError(f"bucket of {size} bytes does not fit a buffer of {buf.numel()} {buf.dtype}")
    flat = buf[:size]
    for m, (_, t) in zip(metas, named):
        flat[m.offset:m.offset + m.nbytes].view(t.dtype).view(t.shape).copy_(t.detach())
    return Bucket(flat=flat, metas=metas)


def flatten(named: list[tuple[str, torch.Tensor]]) -> Bucket:
    """Pack tensors into one new flat byte tensor (on the device of the first tensor)."""
    metas = layout(named)
    return write_into(named, torch.empty(bucket_size(metas), dtype=torch.uint8, device=named[0][1].device))


def empty_like_manifest(metas: list[TensorMeta], device: torch.device | str = "cpu") -> Bucket:
    """A receive buffer with the layout `metas` describes."""
    if not metas:
        raise ValueError("cannot build an empty bucket")
    size = bucket_size(metas)
    return Bucket(flat=torch.empty(size, dtype=torch.uint8, device=device), metas=list(metas))


def unflatten(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """Views into the flat tensor, one per manifest entry (no copy)."""
    out = []
    for m in bucket.metas:
        if m.offset + m.nbytes > bucket.nbytes:
            raise ValueError(f"{m.name}: manifest entry [{m.offset}, {m.offset + m.nbytes}) "
                             f"exceeds bucket of {bucket.nbytes} bytes")
        view = bucket.flat[m.offset:m.offset + m.nbytes].view(m.torch_dtype).reshape(m.shape)
        out.append((m.name, view))
    return out


def plan_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 first_bucket_bytes: int | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of named tensors into lists of at most `bucket_bytes` each.

    With `first_bucket_bytes`, the cap starts there and doubles per bucket up to `bucket_bytes`
    (a ramp): a pipelined push can only overlap bucket k with k+1, so the first bucket's packing
    and the transfer behind it run alone; a small first bucket keeps that unoverlapped part short,
    and doubling stays behind the wire as long as packing is at least twice as fast as it.

    Streaming: only one bucket's tensors are held at a time, so an exporter that materialises
    full (TP-gathered) tensors one by one never has the whole model in memory. A tensor larger
    than the budget travels alone. A tensor whose offset would break dtype alignment (mixed
    dtypes) starts a new bucket.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if first_bucket_bytes is not None and first_bucket_bytes < 1:
        raise ValueError(f"first_bucket_bytes must be >= 1, got {first_bucket_bytes}")
    cap = min(bucket_bytes, first_bucket_bytes or bucket_bytes)
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        _check_tensor(name, t)
        n = t.numel() * t.element_size()
        misaligned = size % t.element_size() != 0
        if cur and (size + n > cap or misaligned):
            yield cur
            cur, size, cap = [], 0, min(bucket_bytes, 2 * cap)
        cur.append((name, t))
        size += n
    if cur:
        yield cur


def ramp_start(bucket_bytes: int) -> int:
    """The first bucket of a pipelined push: 1/16 of the cap, not below 16 MiB. Each bucket costs a
    round trip into SGLang (HTTP, scheduler, load_weights: 9-15 ms on the CPU benchmark server, the
    wire time of 20-30 MB at 2 GB/s) while packing 16 MiB takes ~2 ms: a smaller start adds buckets,
    i.e. pause time, without shortening the unoverlapped part."""
    return min(bucket_bytes, max(bucket_bytes // 16, 16 << 20))


def bucketize(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
              first_bucket_bytes: int | None = None) -> Iterator[Bucket]:
    """plan_buckets followed by flatten."""
    for group in plan_buckets(named, bucket_bytes, first_bucket_bytes):
        yield flatten(group)
