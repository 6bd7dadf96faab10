"""The server side of ``run.sh``: the operator's stack (aiohttp on uvloop, TLS with an ECDSA
P-256 certificate) with two stand-in verbs: ``/filter`` answers at once, ``/bind`` after
``--bind-ms`` (a bind waits for two API writes; on a loaded API server, for seconds).

Usage: ``python server.py CERT KEY PORT [--bind-ms 300]``.
"""

from __future__ import annotations

import argparse
import asyncio
import ssl

from aiohttp import web
from kvgpu.procs import run_loop

ANSWER = b'{"nodenames":["node-1"],"failedNodes":{},"error":""}'


def app(bind_s: float) -> web.Application:
    async def filter_(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=ANSWER, content_type="application/json")

    async def bind(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(bind_s)
        return web.Response(body=b"{}", content_type="application/json")

    a = web.Application()
    a.add_routes([web.post("/filter", filter_), web.post("/bind", bind)])
    return a


async def serve(cert: str, key: str, port: int, bind_s: float) -> None:
    runner = web.AppRunner(app(bind_s), access_log=None)
    await runner.setup()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ctx).start()
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("cert")
    p.add_argument("key")
    p.add_argument("port", type=int)
    p.add_argument("--bind-ms", type=float, default=300.0)
    a = p.parse_args()
    run_loop(serve(a.cert, a.key, a.port, a.bind_ms / 1000))


if __name__ == "__main__":
    main()
