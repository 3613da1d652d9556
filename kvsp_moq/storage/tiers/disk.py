"""The disk tier: one file per replica in a directory, written atomically, read via mmap.

File ``{replica_id hex}.kvsd`` holds the replica's layers that reside on disk, ascending, each
as K || V, after a small self-describing header (format ours)::

    Magic "KVSD" | Version (8) = 1 | 3 zero octets | Meta Length (32) | Data Offset (64)
    Meta: UTF-8 JSON (block key, replica id, codec, first layer, token count, the K/V lengths
          and layer digests of *every* layer of the replica, the layers in this file, creation)
    zero padding up to Data Offset (a multiple of 4096)
    Data: for each layer in the file, ascending: K octets, V octets

Writes are atomic: a temporary file in the same directory is written (positioned writes),
fsynced, renamed over the final name and the directory fsynced, so after a crash a replica's
file is either the old one or the new one, never a torn mix. A change of the layers a replica
keeps on disk writes a new file and renames it over the old one (the layers that stay are
copied). Reads map the file (``mmap``) and hand out views of the mapping: nothing is read
into the Python heap, pages are faulted in when the consumer touches them.

Because the header carries every layer digest (§4.3) and length, :meth:`DiskTier.scan` can
rebuild the replicas after a restart, including the record digest of a replica of which only
some layers were on disk.
"""

from __future__ import annotations

import itertools
import json
import logging
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ...kvsp.container import DIGEST_SIZE
from ..keys import RecordKey, check_replica_id
from ..sources import Section, host_view
from .base import Location, Tier

__all__ = ["DiskFile", "DiskLayer", "DiskMeta", "DiskTier", "FILE_SUFFIX"]

log = logging.getLogger(__name__)

MAGIC = b"KVSD"
FORMAT_VERSION = 1
_HEAD = struct.Struct(">4sB3xIQ")  # magic, version, reserved, meta length, data offset
ALIGN = 4096
FILE_SUFFIX = ".kvsd"
_TMP_SUFFIX = ".tmp"
_MAX_META = 16 << 20
_PLACEHOLDER = "0" * (2 * DIGEST_SIZE)
_counter = itertools.count()


@dataclass(frozen=True)
class DiskMeta:
    """What a replica file says about its replica (all integers, digests raw)."""

    key: RecordKey
    replica_id: bytes
    codec: int
    first_layer: int
    token_count: int
    lengths: tuple[tuple[int, int], ...]  # every layer of the replica, from first_layer
    layer_digests: tuple[bytes | None, ...]  # idem; None only while being written
    file_layers: tuple[int, ...]  # absolute indices of the layers in this file, ascending
    created_ms: int

    def layer_size(self, layer: int) -> int:
        k_len, v_len = self.lengths[layer - self.first_layer]
        return k_len + v_len

    @property
    def payload_size(self) -> int:
        return sum(self.layer_size(layer) for layer in self.file_layers)

    def encode(self) -> bytes:
        """The JSON meta; digests not yet known are written as zeros of the same width, so the
        final meta has exactly the size reserved for the placeholder."""
        obj = {
            "compat_id": self.key.compat_id.hex(),
            "scope_id": self.key.scope_id.hex(),
            "block_key": self.key.block_key.hex(),
            "replica_id": self.replica_id.hex(),
            "codec": self.codec,
            "first_layer": self.first_layer,
            "token_count": self.token_count,
            "lengths": [list(pair) for pair in self.lengths],
            "layer_digests": [d.hex() if d is not None else _PLACEHOLDER for d in self.layer_digests],
            "file_layers": list(self.file_layers),
            "created_ms": self.created_ms,
        }
        return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> DiskMeta:
        """Parse and validate; ``ValueError`` on anything unexpected."""
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError("meta is not an object")

        def integer(name: str, value: object, low: int = 0) -> int:
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"meta {name} must be an integer >= {low}")
            return value

        key = RecordKey.from_hex(obj["compat_id"], obj["scope_id"], obj["block_key"])
        replica_id = check_replica_id(bytes.fromhex(obj["replica_id"]))
        first = integer("first_layer", obj["first_layer"])
        lengths = tuple(
            (integer("lengths", pair[0]), integer("lengths", pair[1])) for pair in obj["lengths"]
        )
        digests = tuple(bytes.fromhex(d) for d in obj["layer_digests"])
        if not lengths or len(digests) != len(lengths):
            raise ValueError("meta lengths and layer_digests must list every layer")
        if any(len(d) != DIGEST_SIZE for d in digests):
            raise ValueError("meta layer digests must be 32 octets")
        file_layers = tuple(integer("file_layers", layer) for layer in obj["file_layers"])
        in_range = all(first <= layer < first + len(lengths) for layer in file_layers)
        if not file_layers or not in_range or list(file_layers) != sorted(set(file_layers)):
            raise ValueError("meta file_layers must be ascending layers of the replica")
        return cls(
            key, replica_id, integer("codec", obj["codec"]), first,
            integer("token_count", obj["token_count"]), lengths, digests, file_layers,
            integer("created_ms", obj["created_ms"]),
        )


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskFile:
    """One replica file: pending (a temporary file being written) until sealed."""

    def __init__(
        self, tier: DiskTier, path: Path, meta: DiskMeta, data_offset: int, fd: int | None
    ) -> None:
        self.tier = tier
        self.path = path
        self.meta = meta
        self.data_offset = data_offset
        self.offsets: dict[int, int] = {}
        pos = data_offset
        for layer in meta.file_layers:
            self.offsets[layer] = pos
            pos += meta.layer_size(layer)
        self.size = pos
        self.payload_size = pos - data_offset
        self.charged = 0  # octets charged to the tier on this file's behalf
        self.replaces: DiskFile | None = None
        self.superseded = False  # renamed over by a newer file of the same replica
        self.removed = False
        self._fd = fd  # open only while pending
        self._map: mmap.mmap | None = None

    @property
    def sealed(self) -> bool:
        return self._fd is None

    def layer(self, layer: int) -> DiskLayer:
        return DiskLayer(self, self.offsets[layer], self.meta.layer_size(layer))

    def write(self, offset: int, section: Section) -> None:
        """Positioned write into the pending file (no fsync until sealed)."""
        assert self._fd is not None, "file is sealed"
        _pwrite_all(self._fd, host_view(section), offset)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A read-only view of the mapped file. The mapping is created on first use and lives
        as long as this object or any view of it, even after the file is unlinked or renamed
        over (POSIX keeps the inode), so a reader never sees octets change under it."""
        if self._map is None:
            fd = self._fd if self._fd is not None else os.open(self.path, os.O_RDONLY)
            try:
                self._map = mmap.mmap(fd, self.size, access=mmap.ACCESS_READ)
            finally:
                if fd != self._fd:
                    os.close(fd)
        return memoryview(self._map)[offset : offset + nbytes]

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __repr__(self) -> str:
        state = "sealed" if self.sealed else "pending"
        return f"DiskFile({self.path.name}, {state}, layers={list(self.meta.file_layers)})"


class DiskLayer(Location):
    """One layer inside a replica file."""

    __slots__ = ("tier", "nbytes", "file", "offset")

    def __init__(self, file: DiskFile, offset: int, nbytes: int) -> None:
        self.tier: DiskTier = file.tier
        self.file = file
        self.offset = offset
        self.nbytes = nbytes

    @property
    def in_memory(self) -> bool:
        return False

    @property
    def zero_copy(self) -> bool:
        return True  # a view of the mapping

    def payload(self) -> memoryview:
        return self.file.view(self.offset, self.nbytes)


class DiskTier(Tier):
    """Replica files in ``directory`` (created if missing)."""

    kind = "disk"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity: int,
        *,
        read_mbit_per_s: float | None = None,
        name: str = "disk",
        fsync: bool = True,
    ) -> None:
        super().__init__(name, capacity, read_mbit_per_s)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync

    def final_path(self, replica_id: bytes) -> Path:
        return self.directory / (replica_id.hex() + FILE_SUFFIX)

    # -- writing ----------------------------------------------------------------------------

    def create(self, meta: DiskMeta, *, replaces: DiskFile | None = None) -> DiskFile:
        """A pending file for ``meta.file_layers``, sized up front, charged to the tier.

        With ``replaces`` (the replica's current file) only the difference is charged, and the
        old file's charge moves to the new one: the layers kept are counted once.
        """
        meta_bytes = meta.encode()
        data_offset = -(-(_HEAD.size + len(meta_bytes)) // ALIGN) * ALIGN
        tmp = self.directory / f".{meta.replica_id.hex()}.{os.getpid()}.{next(_counter)}{_TMP_SUFFIX}"
        net = meta.payload_size - (replaces.charged if replaces is not None else 0)
        if net > 0:
            self.charge(net)
        else:
            self.credit(-net)
        fd = -1
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            file = DiskFile(self, tmp, meta, data_offset, fd)
            os.ftruncate(fd, file.size)
        except BaseException:
            if fd >= 0:
                os.close(fd)
                tmp.unlink(missing_ok=True)
            if net > 0:
                self.credit(net)
            else:
                self.charge(-net)
            raise
        file.charged = meta.payload_size
        if replaces is not None:
            replaces.charged = 0
            file.replaces = replaces
        return file

    def seal(self, file: DiskFile, meta: DiskMeta) -> None:
        """Write the final header, fsync, rename over the final name, fsync the directory."""
        assert not file.sealed and meta.file_layers == file.meta.file_layers
        meta_bytes = meta.encode()
        header = _HEAD.pack(MAGIC, FORMAT_VERSION, len(meta_bytes), file.data_offset) + meta_bytes
        if len(header) > file.data_offset:
            raise AssertionError("final meta larger than reserved")  # digests have fixed width
        assert file._fd is not None
        _pwrite_all(file._fd, memoryview(header), 0)
        if self.fsync:
            os.fsync(file._fd)
        file._close_fd()
        final = self.final_path(meta.replica_id)
        os.replace(file.path, final)
        if self.fsync:
            _fsync_dir(self.directory)
        file.path = final
        file.meta = meta
        old, file.replaces = file.replaces, None
        if old is not None:
            old.superseded = True  # its path is now the new file; its mapping stays valid

    def discard(self, file: DiskFile) -> None:
        """Drop a pending file (undoing its charge, giving a replaced file its charge back) or
        remove a sealed one (unlinking it unless a newer file was renamed over it)."""
        if file.removed:
            return
        file.removed = True
        self.credit(file.charged)
        file.charged = 0
        old, file.replaces = file.replaces, None
        if not file.sealed:
            file._close_fd()
            file.path.unlink(missing_ok=True)
            if old is not None:  # the old file stays current
                self.charge(old.meta.payload_size)
                old.charged = old.meta.payload_size
            return
        if not file.superseded:
            file.path.unlink(missing_ok=True)
            if self.fsync:
                _fsync_dir(self.directory)

    def forget(self, file: DiskFile) -> None:
        """Stop accounting a sealed file but leave it on disk (shutdown; see ``scan``)."""
        self.credit(file.charged)
        file.charged = 0
        file.removed = True

    def write_file(
        self, meta: DiskMeta, payloads: Sequence[Section], *, replaces: DiskFile | None = None
    ) -> DiskFile:
        """Create, fill and seal a file; ``payloads`` are the K || V octets of
        ``meta.file_layers`` in order (views of other tiers, of the replaced file's mapping,
        or tensors). On an error the pending file is discarded and ``replaces`` stays."""
        file = self.create(meta, replaces=replaces)
        try:
            for layer, payload in zip(meta.file_layers, payloads, strict=True):
                file.write(file.offsets[layer], payload)
            self.seal(file, meta)
        except BaseException:
            self.discard(file)
            raise
        return file

    # -- recovery ---------------------------------------------------------------------------

    def scan(self) -> list[DiskFile]:
        """The sealed replica files in the directory, uncharged (see :meth:`adopt`).

        Leftover temporary files (a crash while writing) are removed; files that are not
        valid replica files are removed too and logged.
        """
        found: list[DiskFile] = []
        for entry in sorted(os.scandir(self.directory), key=lambda e: e.name):
            path = Path(entry.path)
            if entry.name.startswith(".") and entry.name.endswith(_TMP_SUFFIX):
                log.warning("removing unfinished replica file %s", path)
                path.unlink(missing_ok=True)
                continue
            if not entry.name.endswith(FILE_SUFFIX) or not entry.is_file():
                continue
            try:
                found.append(self._open(path))
            except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
                log.warning("removing invalid replica file %s: %s", path, exc)
                path.unlink(missing_ok=True)
        return found

    def adopt(self, file: DiskFile) -> None:
        """Charge a scanned file to the tier (``StoreFull`` when it does not fit)."""
        self.charge(file.payload_size)
        file.charged = file.payload_size

    def _open(self, path: Path) -> DiskFile:
        with open(path, "rb") as fh:
            head = fh.read(_HEAD.size)
            magic, version, meta_len, data_offset = _HEAD.unpack(head)
            if magic != MAGIC or version != FORMAT_VERSION or meta_len > _MAX_META:
                raise ValueError("not a replica file of this version")
            meta = DiskMeta.decode(fh.read(meta_len))
            size = os.fstat(fh.fileno()).st_size
        if data_offset < _HEAD.size + meta_len or data_offset % ALIGN:
            raise ValueError("bad data offset")
        if path.name != meta.replica_id.hex() + FILE_SUFFIX:
            raise ValueError("file name does not match the replica id")
        file = DiskFile(self, path, meta, data_offset, None)
        if size != file.size:
            raise ValueError(f"file has {size} octets, its header says {file.size}")
        return file
