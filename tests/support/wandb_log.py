"""Read the history of an offline W&B run from its `run-<id>.wandb` file.

wandb >= 0.19 writes that file from its Go core and no longer ships the Python reader; the format is a
short W&B header, then the LevelDB log format (32 KiB blocks of records with a 7-byte header:
crc32, length, type FULL/FIRST/MIDDLE/LAST), each record a serialized `wandb_internal_pb2.Record`
(wandb's own protobuf, used here to decode).
"""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

BLOCK = 32768
FILE_HEADER = 7  # b":W&B", magic 0xBEE1, version
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out: list[bytes] = []
    pending = b""
    pos = FILE_HEADER
    while pos + 7 <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < 7:  # a block's tail too short for a header is padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind not in (FULL, FIRST, MIDDLE, LAST):  # zeros: the rest of the block is padding
            pos += left_in_block
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
            pending = b""
    return out


def history(path: Path, wait_s: float = 60.0) -> list[tuple[int, dict]]:
    """(step, {key: value}) of every `run.log` in the file, in order. The file is written by wandb's own
    service process, which may still be writing it after `run.finish()` returned in ours (seen under
    load: only the file header on disk): wait up to `wait_s` for the run's exit record."""
    from wandb.proto import wandb_internal_pb2 as pb

    deadline = time.monotonic() + wait_s
    while True:
        parsed = []
        for raw in records(path):
            record = pb.Record()
            record.ParseFromString(raw)
            parsed.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in parsed) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    out = []
    for record in parsed:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            out.append((record.history.step.num, items))
    return out
