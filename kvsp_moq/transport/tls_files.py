"""PEM material written to files for QUIC libraries that read TLS credentials only from paths
(picoquic through aiopquic, GnuTLS in the native backend): :class:`TlsFiles`."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

__all__ = ["TlsFiles"]


class TlsFiles:
    """A private temporary directory (mode 0700, files 0600) for PEM material a library must
    read from files; removed by :meth:`cleanup`, or on leaving it as a context manager."""

    def __init__(self, prefix: str = "kvsp-tls-") -> None:
        self._prefix = prefix
        self._dir: Path | None = None

    def write(self, name: str, data: bytes) -> str:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix=self._prefix))  # mode 0700
        path = self._dir / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fp:
            fp.write(data)
        return str(path)

    def cleanup(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> TlsFiles:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.cleanup()
