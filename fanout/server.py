"""tabby-typha's gRPC service: the ``Sync`` stream of ``typha.proto`` over grpcio's asyncio
server with a generic handler (the messages are ``fanout.wire``'s, no generated code), mutual
TLS, and the client's identity checked as Typha checks it: its certificate's common name or
a URI subject alternative name among the allowed ones."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import grpc

from datastore.protobuf import ProtoError
from fanout import SERVICE, wire
from fanout.hub import Client, Handshakes, Hub

if TYPE_CHECKING:
    from grpc.aio import ServicerContext

log = logging.getLogger("tabby.typha")


@dataclass(frozen=True)
class Tls:
    """The server's certificate and key and the CA its clients' certificates are checked
    against (PEM bytes), and who may connect (empty both: any certificate of the CA)."""

    ca: bytes
    cert: bytes
    key: bytes
    client_cns: Sequence[str] = ()
    client_uri_sans: Sequence[str] = ()


def refused(auth: Mapping[str, Iterable[bytes]], tls: Tls | None) -> str | None:
    """Why a peer (grpc's auth context) may not connect; None: it may."""
    if tls is None:
        return None
    cns = {v.decode(errors="replace") for v in auth.get("x509_common_name", [])}
    sans = {
        v.decode(errors="replace")
        for key in ("x509_uri", "x509_subject_alternative_name")
        for v in auth.get(key, [])
    }
    if not cns and not sans and not list(auth.get("x509_pem_cert", [])):
        return "no certificate"
    if not tls.client_cns and not tls.client_uri_sans:
        return None
    if cns & set(tls.client_cns) or sans & set(tls.client_uri_sans):
        return None
    return "identity"


class Service:
    def __init__(self, hub: Hub, tls: Tls | None) -> None:
        self.hub = hub
        self.tls = tls

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Sync": grpc.stream_stream_rpc_method_handler(
                    self.sync,
                    request_deserializer=wire.decode_client,
                    response_serializer=bytes,
                )
            },
        )

    async def sync(
        self,
        requests: AsyncIterator[wire.ClientMessage],
        context: ServicerContext[wire.ClientMessage, bytes],
    ) -> AsyncIterator[bytes]:
        peer = context.peer()
        handshakes = self.hub.stats.handshakes
        handshakes.opened(peer)
        try:
            why = refused(context.auth_context(), self.tls)
            if why is not None:
                self._refuse(why)
                log.warning("refused %s: %s", peer, why)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"refused: {why}")
            if not self.hub.ready:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no datastore snapshot yet")
            try:
                hello = await requests.__anext__()
            except (StopAsyncIteration, ProtoError):
                return
            if not hello.node:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "the first message names no node"
                )
            unserved = self.hub.unserved(hello.kinds)
            if unserved:
                self._refuse("kinds")
                log.warning("refused %s (%s): typha does not serve %s", peer, hello.node, unserved)
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"this typha does not serve {', '.join(unserved)} (an older version?)",
                )
            client = Client(hello.node)
            acks = asyncio.create_task(_acks(requests, client))
            try:
                async for message in self.hub.stream(client, hello):
                    yield message
            finally:
                acks.cancel()
        finally:
            handshakes.closed(peer)

    def _refuse(self, why: str) -> None:
        refusals = self.hub.stats.refused
        refusals[why] = refusals.get(why, 0) + 1


async def _acks(requests: AsyncIterator[wire.ClientMessage], client: Client) -> None:
    with contextlib.suppress(ProtoError, grpc.RpcError, asyncio.CancelledError):
        async for message in requests:
            client.acked = max(client.acked, message.ack)


#: HTTP/2 keepalive: a client gone without a FIN is noticed within ~a minute; clients may
#: ping every 10 s (``fanout.client``)
SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 64 << 10),
]


async def start(hub: Hub, address: str, tls: Tls | None) -> grpc.aio.Server:
    """Serve ``hub`` on ``address`` (``host:port``); plaintext without ``tls``. The port
    bound is ``server.port`` (``address`` may ask for port 0)."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    service = Service(hub, tls)
    server.add_generic_rpc_handlers((service.handler(),))
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, _credentials(tls, hub.stats.handshakes))
    if not port:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    server.port = port  # type: ignore[attr-defined]
    return server


def _credentials(tls: Tls, handshakes: Handshakes) -> grpc.ServerCredentials:
    """Mutual TLS whose certificate fetcher, which grpcio calls once per accepted connection
    before its handshake, counts the handshakes (``Handshakes``); it changes nothing (the
    certificate stays the one given)."""
    config = grpc.ssl_server_certificate_configuration([(tls.key, tls.cert)], tls.ca)

    def fetch() -> grpc.ServerCertificateConfiguration:
        handshakes.begin()
        # None: keep the configuration (grpcio's stub does not say it may be None)
        return cast("grpc.ServerCertificateConfiguration", None)

    return grpc.dynamic_ssl_server_credentials(config, fetch, require_client_authentication=True)
