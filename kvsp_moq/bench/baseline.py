"""The baseline every hot-path benchmark is compared with in the same run (DESIGN.md §6): a raw
TCP socket copy of the same bytes over loopback (``sendall`` from one thread, ``recv_into``
one buffer in another)."""

from __future__ import annotations

import socket
import threading
import time

__all__ = ["tcp_copy"]


def tcp_copy(data: bytes, object_size: int) -> tuple[float, float]:
    """(seconds for the whole copy, seconds to the first ``object_size`` bytes)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    buf = bytearray(len(data))
    marks: dict[str, float] = {}

    def receive() -> None:
        conn, _ = listener.accept()
        with conn:
            view = memoryview(buf)
            got = 0
            while got < len(buf):
                n = conn.recv_into(view[got:])
                if n == 0:
                    break
                got += n
                if "first" not in marks and got >= object_size:
                    marks["first"] = time.perf_counter()
        marks["end"] = time.perf_counter()

    thread = threading.Thread(target=receive)
    thread.start()
    with socket.create_connection(("127.0.0.1", port)) as client:
        start = time.perf_counter()
        client.sendall(data)
    thread.join()
    listener.close()
    if bytes(buf) != data:
        raise AssertionError("TCP copy corrupted the data")
    return marks["end"] - start, marks["first"] - start
