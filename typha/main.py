"""tabby-typha, the fan-out (Typha's role): one ``store.sync`` of the kinds every tabby-node
watches, held as each node's view (``fanout.hub``), served over gRPC with mutual TLS
(``fanout.server``); ``/liveness``, ``/readiness`` and ``/metrics`` over ``daemon.http``.

Threads: the asyncio loop (the main thread: the hub and every client's stream), the store's
``sync`` (its events handed to the loop), the HTTP servers. docs/typha.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

from fanout.hub import Bounds, Hub
from ipam.core.errors import DatastoreError
from resources.index import NODE_KINDS

if TYPE_CHECKING:
    from http.server import ThreadingHTTPServer

    from datastore.base import Store
    from fanout.server import Tls
    from typha.options import TyphaOptions

log = logging.getLogger("tabby.typha")

STALL = 30.0  #: seconds without a loop tick before /liveness fails
#: What typha syncs and serves: every kind a tabby-node watches (a client asking for another
#: is refused; tests/unit/typha/test_kinds.py keeps this, tabby-node's watch and typha's
#: ClusterRole the same)
KINDS: tuple[str, ...] = NODE_KINDS


class Typha:
    def __init__(self, options: TyphaOptions, store: Store) -> None:
        self.options = options
        self.store = store
        self.hub = Hub(
            Bounds(
                options.history_events,
                options.history_bytes,
                min_interval=options.send_interval,
            ),
            kinds=KINDS,
        )
        self.stopping = threading.Event()
        self.serving = False
        self.beat = time.monotonic()
        self.problems: dict[str, str] = {}
        self.port = 0

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """The store's ``sync`` into the hub, until stopping (a broken watch opened again
        after 0.2 s, doubling to 5 s; the hub turns its new snapshot into differences)."""
        delay = 0.2
        while not self.stopping.is_set():
            try:
                for event in self.store.sync(KINDS, self.stopping):
                    try:
                        loop.call_soon_threadsafe(self.hub.apply, event)
                    except RuntimeError:  # the loop is closed: typha is stopping
                        return
                    self.problems.pop("watch", None)
                    delay = 0.2
            except DatastoreError as e:
                self.problems["watch"] = str(e)
                log.warning("datastore watch: %s (again in %.1f s)", e, delay)
                self.stopping.wait(delay)
                delay = min(delay * 2, 5.0)

    async def run(self, tls: Tls | None) -> None:
        from fanout import server

        loop = asyncio.get_running_loop()
        threading.Thread(target=self.watch, args=(loop,), name="watch", daemon=True).start()
        address = f"{_host(self.options.listen)}:{self.options.port}"
        grpc_server = await server.start(self.hub, address, tls)
        self.port = grpc_server.port  # type: ignore[attr-defined]
        self.serving = True
        log.warning("tabby-typha serving on %s (%s)", address, "mTLS" if tls else "plaintext")
        try:
            while not self.stopping.is_set():
                self.beat = time.monotonic()
                self.hub.tick()
                await asyncio.sleep(0.5)
        finally:
            self.serving = False
            await grpc_server.stop(grace=1.0)

    def liveness(self) -> list[str]:
        stalled = time.monotonic() - self.beat
        return [f"the loop has not run for {stalled:.0f} s"] if stalled > STALL else []

    def readiness(self) -> list[str]:
        why = [f"{k}: {v}" for k, v in sorted(self.problems.items())]
        if not self.hub.ready:
            why.append("no datastore snapshot yet")
        if not self.serving:
            why.append("not serving")
        return why


def _host(listen: str) -> str:
    return f"[{listen}]" if ":" in listen else listen


def _read(path: str | None) -> bytes:
    assert path is not None
    with open(path, "rb") as f:
        return f.read()


def main(argv: list[str] | None = None) -> int:
    from cni_protocol import log as cni_log
    from cni_protocol.errors import CniError
    from daemon.signals import stop_on_signals
    from fanout.server import Tls
    from stores import open_store
    from typha.options import parse

    try:
        options, settings = parse(argv)
        tls = None
        if not options.plaintext:
            tls = Tls(
                _read(options.ca_file),
                _read(options.cert_file),
                _read(options.key_file),
                options.client_cns,
                options.client_uri_sans,
            )
    except CniError as e:
        print(f"tabby-typha: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"tabby-typha: cannot read a TLS file: {e}", file=sys.stderr)
        return 2
    cni_log.setup_resident(options.log_level, options.log_file)
    try:
        store = open_store(settings)
    except DatastoreError as e:
        print(f"tabby-typha: {e}", file=sys.stderr)
        return 1
    typha = Typha(options, store)
    servers = _serve_http(typha)
    with stop_on_signals(typha.stopping):
        try:
            asyncio.run(typha.run(tls))
        except OSError as e:
            print(f"tabby-typha: {e}", file=sys.stderr)
            return 1
        finally:
            from daemon.http import stop

            typha.stopping.set()
            stop(servers)
            store.close()
    log.warning("tabby-typha stopped")
    return 0


def _serve_http(typha: Typha) -> list[ThreadingHTTPServer]:
    from daemon.http import Endpoints, serve
    from typha.metrics import Metrics

    options = typha.options
    metrics = Metrics(typha.hub).exposition if options.metrics_port else None
    endpoints = Endpoints(typha.liveness, typha.readiness, metrics)
    servers: list[ThreadingHTTPServer] = []
    wanted = [("health", options.health_port, ["127.0.0.1"])]
    pod_ip = os.environ.get("POD_IP", "")
    wanted.append(("metrics", options.metrics_port, ["127.0.0.1", *([pod_ip] if pod_ip else [])]))
    for what, port, hosts in wanted:
        if not port:
            continue
        for host in hosts:
            try:
                servers.append(serve(host, port, endpoints, "tabby-typha", label=what))
            except OSError as e:
                typha.problems[f"http {what}"] = f"cannot listen on {host}:{port}: {e}"
    return servers
