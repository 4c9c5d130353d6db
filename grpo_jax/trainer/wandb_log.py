"""What a Weights & Biases run's local transaction logs hold: the `.wandb` file W&B writes in
each launch's directory (an offline run lives only there until `wandb sync` uploads it), read
the way `wandb sync` reads it (wandb-core's transactionlog and runsync packages).

Format (wandb-core's pkg/leveldb): a 7-byte header (":W&B", the magic 0xBEE1 little-endian,
version 0), then LevelDB log blocks of 32 KiB. A chunk is a 7-byte header (CRC-32 (IEEE) of
its type byte and payload, u16 payload length, type: 1 full, 2 first, 3 middle, 4 last) and
its payload; a block's tail too short for a header is zero padding. A record (one chunk, or a
first, middles and a last) is a serialized `wandb_internal_pb2.Record`.

Why it matters: wandb-core writes a block only when it is full (and the rest at the run's
end; the SDK has no call that flushes it), and it stops without writing when its parent
process dies. A launch killed with SIGKILL leaves a file cut at a block boundary (or inside a
block, if the kill came during a write): the W&B run lacks the steps logged last, however
long ago they were sent. `wandb sync` uploads the records before the first chunk that is cut
short or fails its checksum, and `records` stops there too, so `last_step` is what the W&B run
will hold once synced.
"""

from __future__ import annotations

import glob
import os
import struct
import zlib
from collections.abc import Iterator, Sequence

BLOCK_BYTES = 32 * 1024
CHUNK_HEADER_BYTES = 7
FILE_HEADER = b":W&B" + struct.pack("<H", 0xBEE1) + bytes([0])  # ident, magic, version 0
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str) -> Iterator:
    """The records (`wandb_internal_pb2.Record`) of a .wandb file, in order, up to the first
    chunk that is cut short, fails its checksum or does not continue its record (what `wandb
    sync` uploads of a file a kill cut).

    Raises:
      ValueError: the file does not start with the header of a version-0 W&B transaction log.
    """
    from google.protobuf import message
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    if data[: len(FILE_HEADER)] != FILE_HEADER:
        raise ValueError(f"{path} does not start with the header of a W&B transaction log of "
                         f"version 0 ({data[:7]!r}); this wandb writes a format grpo_jax cannot "
                         "read")  # fmt: skip
    pos, parts = len(FILE_HEADER), None
    while True:
        left = BLOCK_BYTES - pos % BLOCK_BYTES
        if left < CHUNK_HEADER_BYTES:  # padding to the block's end
            pos += left
            continue
        if pos + CHUNK_HEADER_BYTES > len(data):
            return  # the end, or a header cut short
        checksum, length, kind = struct.unpack_from("<IHB", data, pos)
        if parts is None and (checksum, length, kind) == (0, 0, 0):
            pos += left  # a zeroed block tail (preallocated files): wandb skips to the next block
            continue
        end = pos + CHUNK_HEADER_BYTES + length
        if length > left - CHUNK_HEADER_BYTES or end > len(data):
            return  # cut short: the kill came before the block was written whole
        if zlib.crc32(data[pos + CHUNK_HEADER_BYTES - 1 : end]) != checksum:
            return
        payload, pos = data[pos + CHUNK_HEADER_BYTES : end], end
        if parts is None:
            if kind not in (FULL, FIRST):
                continue  # the rest of a record whose start is missing: wandb skips it
            parts = [payload]
        elif kind in (MIDDLE, LAST):
            parts.append(payload)
        else:
            return
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(b"".join(parts))
            except message.DecodeError:
                return
            yield record
            parts = None


def offline_logs(wandb_dir: str, run_id: str) -> list[str]:
    """The .wandb files of the offline launches of run `run_id` under `wandb_dir` (W&B's
    `offline-run-<time>-<id>/run-<id>.wandb`), oldest first."""
    pattern = os.path.join(glob.escape(wandb_dir), f"offline-run-*-{glob.escape(run_id)}",
                           f"run-{glob.escape(run_id)}.wandb")  # fmt: skip
    return sorted(glob.glob(pattern))


def last_step(paths: Sequence[str]) -> int:
    """The last step of a history row (a logged and committed step) in these .wandb files;
    -1 when none holds one."""
    steps = [r.history.step.num for path in paths for r in records(path)
             if r.WhichOneof("record_type") == "history"]  # fmt: skip
    return max(steps, default=-1)
