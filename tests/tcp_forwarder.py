"""A TCP forwarder in a process of its own, for tests that stall a peer (SIGSTOP) that lives in
the test process: ``python tests/tcp_forwarder.py HOST PORT`` listens on 127.0.0.1 (a free port),
prints ``http://127.0.0.1:<port>/`` as its first line, and copies bytes both ways between each
connection and HOST:PORT until either side closes. Stopped with SIGSTOP, every connection through
it stalls (no FIN, no reset); SIGCONT resumes them; it exits when its stdin closes."""

from __future__ import annotations

import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def main(host: str, port: int) -> None:
    async def forward(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(host, port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, server_w), _pipe(server_r, client_w))

    server = await asyncio.start_server(forward, "127.0.0.1", 0)
    print(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the test closes our stdin
    server.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
