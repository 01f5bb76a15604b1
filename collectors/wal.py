"""Write-ahead log and archive of originals: each export request, as received, once on disk.

Each accepted export request is appended as ``length (4 bytes) | crc32 (4 bytes) | bytes``
to the current segment and flushed to the operating system before the sender hears "OK"
(``fsync=True`` also forces it to the device, for power loss; a killed process loses
nothing either way). The store records, in the same transaction as the rows, the position
up to which the log is applied; on restart everything after it is replayed. A torn record
at the tail (a crash mid-append) is detected by length or CRC and cut off.

The same records are the archive of the original requests: the store keeps columns and a
pointer (segment, end offset, length) per request, not a second copy of the bytes (which
cost more CPU than everything else the store does). Applied segments are deleted oldest
first once the log is over ``archive_bytes``; a pointer into a deleted segment reads as
``None``.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from pathlib import Path
from typing import Iterator

_HEADER = struct.Struct("<II")
SEGMENT_BYTES = 64 * 1024 * 1024
ARCHIVE_BYTES = 4 * 1024**3  # applied segments kept, as the archive of originals


def _segment_name(number: int) -> str:
    return f"wal-{number:08d}.log"


class WriteAheadLog:
    """Positions are ``(segment number, byte offset after the record)``."""

    def __init__(self, directory: str | os.PathLike, *, fsync: bool = False,
                 segment_bytes: int = SEGMENT_BYTES, archive_bytes: int = ARCHIVE_BYTES) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._fsync = fsync
        self._segment_bytes = segment_bytes
        self._archive_bytes = archive_bytes
        self._lock = threading.Lock()
        segments = self.segments()
        self._number = segments[-1] if segments else 1
        self._repair_tail(self._number)
        self._file = open(self.directory / _segment_name(self._number), "ab")

    def segments(self) -> list[int]:
        return sorted(int(p.name[4:12]) for p in self.directory.glob("wal-*.log"))

    def append(self, payload: bytes) -> tuple[int, int]:
        header = _HEADER.pack(len(payload), zlib.crc32(payload))
        with self._lock:
            if self._file.tell() >= self._segment_bytes:
                self._rotate()
            self._file.write(header + payload)
            self._file.flush()
            if self._fsync:
                os.fsync(self._file.fileno())
            return self._number, self._file.tell()

    def _rotate(self) -> None:
        self._file.close()
        self._number += 1
        self._file = open(self.directory / _segment_name(self._number), "ab")

    def replay(self, after: tuple[int, int]) -> Iterator[tuple[tuple[int, int], bytes]]:
        """Records after position ``after``, with the position each one ends at."""
        for number in self.segments():
            if number < after[0]:
                continue
            with open(self.directory / _segment_name(number), "rb") as handle:
                if number == after[0]:
                    handle.seek(after[1])
                while True:
                    record = _read_record(handle)
                    if record is None:
                        break
                    yield (number, handle.tell()), record

    def read(self, segment: int, end: int, length: int) -> bytes | None:
        """The record of ``length`` bytes ending at ``(segment, end)``; None once deleted (or damaged)."""
        return read_record(self.directory, segment, end, length)

    def release(self, applied: tuple[int, int]) -> int:
        """Everything up to ``applied`` is in the store: delete the oldest segments before it
        while the log is over ``archive_bytes``. Returns how many were deleted."""
        with self._lock:
            sizes = {n: (self.directory / _segment_name(n)).stat().st_size for n in self.segments()}
            total, deleted = sum(sizes.values()), 0
            for number, size in sizes.items():
                if total <= self._archive_bytes or number >= applied[0] or number == self._number:
                    break
                (self.directory / _segment_name(number)).unlink(missing_ok=True)
                total -= size
                deleted += 1
            return deleted

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def _repair_tail(self, number: int) -> None:
        path = self.directory / _segment_name(number)
        if not path.exists():
            return
        good = 0
        with open(path, "rb") as handle:
            while _read_record(handle) is not None:
                good = handle.tell()
        if good != path.stat().st_size:
            with open(path, "r+b") as handle:
                handle.truncate(good)


def read_record(directory: str | os.PathLike, segment: int, end: int, length: int) -> bytes | None:
    """One archived record, read without opening the log (a reader beside a stopped collector)."""
    try:
        with open(Path(directory) / _segment_name(segment), "rb") as handle:
            handle.seek(end - length - _HEADER.size)
            return _read_record(handle)
    except (OSError, ValueError):  # the segment is gone, or the pointer is past its end
        return None


def _read_record(handle) -> bytes | None:
    header = handle.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    length, crc = _HEADER.unpack(header)
    payload = handle.read(length)
    if len(payload) < length or zlib.crc32(payload) != crc:
        return None
    return payload
