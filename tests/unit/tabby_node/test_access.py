"""Who may read the policy log (tabby_node.access, daemon.http's guard): 127.0.0.1, a client
certificate of an allowed name, a Kubernetes bearer token the API server authenticates and
authorizes (tests/kube_fake.py answers the reviews); 401, 403 and 503 otherwise, counted;
``/metrics`` and health open; the metrics port over TLS; tabbyctl's credentials."""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from daemon.http import Caller, Endpoints, serve, stop
from lab.kubernetes.pki import KeyPair, Pki
from stores.kube.client import KubeClient, KubeConfig
from tabby_node.access import Door, TokenReviewer, common_name, loopback
from tabby_node.http import tls_context
from tabby_node.metrics import Metrics
from tabby_node.options import parse
from tabby_node.policylog import DeniedFlows, http_route
from tabbyctl.policy_log import Credentials, LogError, Source, fetch
from tests.kube_fake import API_AUDIENCE, FakeApi, fake_api

NODE = "node-a"
LOG = "/policy/log"
READER = ("system:serviceaccount:mon:reader", ("system:serviceaccounts",), ("tabby-node",))
OUTSIDER = ("system:serviceaccount:mon:other", ("system:serviceaccounts",), ("tabby-node",))
GRANT = ("system:serviceaccount:mon:reader", "get", "tabby.io/nodes/policylog", "*")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Reviews:
    api: FakeApi
    reviewer: TokenReviewer
    clock: Clock

    def posts(self) -> int:
        return sum(1 for r in self.api.requests if r.startswith("POST"))


@pytest.fixture
def reviews(tmp_path: Path) -> Iterator[Reviews]:
    with fake_api() as (api, url):
        api.tokens = {"good": READER, "other": OUTSIDER, "api-only": (*READER[:2], (API_AUDIENCE,))}
        api.grants = {GRANT}
        clock = Clock()
        client = KubeClient(KubeConfig(server=url, token="tabby-node-token"), timeout=2)
        reviewer = TokenReviewer(client, NODE, ("tabby-node",), clock=clock, size=2)
        try:
            yield Reviews(api, reviewer, clock)
        finally:
            client.close()


def remote(
    path: str = LOG, token: str | None = None, cert: dict[str, object] | None = None
) -> Caller:
    return Caller(path, "192.0.2.7", f"Bearer {token}" if token else None, cert)


def cert_of(cn: str) -> dict[str, object]:
    return {"subject": ((("organizationName", "x"),), (("commonName", cn),))}


# -- the decision --------------------------------------------------------------------------------


def test_root_on_the_node_reads_without_credentials() -> None:
    door = Door()
    for address in ("127.0.0.1", "::1", "127.0.0.53"):
        assert door(Caller(LOG, address)) == (200, "loopback")
    assert not loopback("10.0.0.1")
    assert not loopback("not an address")


def test_no_credential_is_401_and_counted() -> None:
    metrics = Metrics()
    door = Door(refused=metrics.http_refused)
    code, why = door(remote())
    assert code == 401
    assert "authenticate" in why
    assert door(remote(token="x"))[0] == 401  # tokens, but nobody reviews them here
    labels = {"path": LOG, "code": "401"}
    assert metrics.registry.get_sample_value("tabby_http_refusals_total", labels) == 2


def test_a_token_is_reviewed_then_authorized_for_this_node(reviews: Reviews) -> None:
    door = Door(reviewer=reviews.reviewer)
    assert door(remote(token="good"))[0] == 200
    code, why = door(remote(token="other"))
    assert code == 403
    assert "may not get nodes/policylog (tabby.io) of node node-a" in why
    assert door(remote(token="forged"))[0] == 401
    code, why = door(remote(token="api-only"))  # a token for the API server, not for us
    assert (code, "audiences" in why) == (401, True)
    # the access review named this node and the user's groups
    reviews.api.grants = {("system:serviceaccounts", "get", "tabby.io/nodes/policylog", "node-b")}
    reviews.clock.now += 60
    assert door(remote(token="other"))[0] == 403
    reviews.api.grants = {("system:serviceaccounts", "get", "tabby.io/nodes/policylog", NODE)}
    reviews.clock.now += 60
    assert door(remote(token="other"))[0] == 200


def test_reviews_are_cached_briefly_and_the_cache_is_bounded(reviews: Reviews) -> None:
    door = Door(reviewer=reviews.reviewer)
    assert door(remote(token="good"))[0] == 200
    first = reviews.posts()
    assert first == 2  # a TokenReview and a SubjectAccessReview
    for _ in range(50):  # a scrape storm
        assert door(remote(token="good"))[0] == 200
        assert door(remote(token="forged"))[0] == 401
    assert reviews.posts() == first + 1  # the forged token's review, once
    # the grant withdrawn: still allowed until the answer expires, then refused
    reviews.api.grants = set()
    assert door(remote(token="good"))[0] == 200
    reviews.clock.now += 11
    assert door(remote(token="good"))[0] == 403
    # at most 2 tokens remembered (size=2): a third pushes the oldest out
    before = reviews.posts()
    door(remote(token="other"))
    door(remote(token="forged"))
    door(remote(token="good"))  # forgotten: reviewed again
    assert reviews.posts() > before + 3
    assert len(reviews.reviewer._cache) == 2


def test_an_api_server_that_cannot_review_is_503_not_open(reviews: Reviews) -> None:
    metrics = Metrics()
    door = Door(reviewer=reviews.reviewer, refused=metrics.http_refused)
    reviews.api.unauthorized = True  # tabby-node's own token refused
    code, why = door(remote(token="good"))
    assert code == 503
    assert "cannot review" in why
    reviews.api.stop()  # and the API server gone
    assert door(remote(token="good"))[0] == 503
    labels = {"path": LOG, "code": "503"}
    assert metrics.registry.get_sample_value("tabby_http_refusals_total", labels) == 2


def test_a_client_certificate_must_carry_an_allowed_name() -> None:
    door = Door(client_cns=("tabbyctl", "ops"))
    assert door(remote(cert=cert_of("ops")))[0] == 200
    code, why = door(remote(cert=cert_of("node-b")))
    assert code == 403
    assert "'node-b'" in why
    assert Door()(remote(cert=cert_of("tabbyctl")))[0] == 403  # no names: none allowed
    assert common_name({"subject": ()}) is None
    assert common_name({}) is None


def test_either_credential_suffices(reviews: Reviews) -> None:
    door = Door(client_cns=("tabbyctl",), reviewer=reviews.reviewer)
    assert door(remote(token="good", cert=cert_of("nobody")))[0] == 200
    assert door(remote(token="forged", cert=cert_of("tabbyctl")))[0] == 200
    # authenticated by one, allowed by neither: 403, both reasons said
    code, why = door(remote(token="forged", cert=cert_of("nobody")))
    assert code == 403
    assert "nobody" in why
    assert "token not accepted" in why


def test_only_the_private_paths_are_served_remotely() -> None:
    door = Door(client_cns=("tabbyctl",))
    assert door(remote("/other", cert=cert_of("tabbyctl")))[0] == 403


# -- over HTTP -------------------------------------------------------------------------------------


def _endpoints(guard: Door, flows: DeniedFlows | None = None) -> Endpoints:
    flows = flows or DeniedFlows(NODE)
    return Endpoints(
        list,
        list,
        lambda accept: ("text/plain", b"tabby_node_up 1\n"),
        {LOG: http_route(flows)},
        private=frozenset({LOG}),
        guard=guard,
    )


def get(
    port: int,
    path: str,
    token: str | None = None,
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, str], bytes]:
    conn: http.client.HTTPConnection
    if context is not None:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=context)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def test_the_handler_asks_the_guard_for_the_log_only(reviews: Reviews) -> None:
    metrics = Metrics()
    # the peer as if it came from another machine (every test peer is on loopback)
    door = Door(reviewer=reviews.reviewer, refused=metrics.http_refused, local=lambda a: False)
    server = serve("127.0.0.1", 0, _endpoints(door), "test")
    port = server.server_address[1]
    try:
        code, headers, body = get(port, LOG)
        assert code == 401
        assert headers["WWW-Authenticate"].startswith("Bearer")
        assert b"authenticate" in body
        assert get(port, LOG, "other")[0] == 403
        code, _, body = get(port, f"{LOG}?since=0", "good")
        assert code == 200
        assert json.loads(body)["node"] == NODE
        # metrics and health: open to anyone
        assert get(port, "/metrics")[:3:2] == (200, b"tabby_node_up 1\n")
        assert get(port, "/readiness")[0] == 200
        assert get(port, "/liveness")[0] == 200
    finally:
        stop([server])
    for status in ("401", "403"):
        labels = {"path": LOG, "code": status}
        assert metrics.registry.get_sample_value("tabby_http_refusals_total", labels) == 1


def test_the_handler_serves_loopback_with_the_real_door() -> None:
    server = serve("127.0.0.1", 0, _endpoints(Door()), "test")
    try:
        assert get(server.server_address[1], LOG)[0] == 200
    finally:
        stop([server])


def test_a_guard_that_fails_is_503() -> None:
    def broken(caller: Caller) -> tuple[int, str]:
        raise RuntimeError("boom")

    endpoints = Endpoints(
        list,
        list,
        None,
        {LOG: lambda q: (200, "text/plain", b"x")},
        private=frozenset({LOG}),
        guard=broken,
    )
    server = serve("127.0.0.1", 0, endpoints, "test")
    try:
        assert get(server.server_address[1], LOG)[0] == 503
    finally:
        stop([server])
    with pytest.raises(ValueError, match="guard"):
        Endpoints(list, list, private=frozenset({LOG}))


# -- TLS -------------------------------------------------------------------------------------------


@dataclass
class Certs:
    ca: Path
    server: KeyPair
    reader: KeyPair
    stranger: KeyPair
    foreign: KeyPair  # signed by another CA


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is missing (apt-get install openssl)")
    d = tmp_path_factory.mktemp("pki")
    pki, other = Pki(d / "a", "tabby-test"), Pki(d / "b", "elsewhere")
    return Certs(
        pki.ca.cert,
        pki.issue("node", "node-a", sans=("IP:127.0.0.1",), server=True),
        pki.issue("reader", "tabbyctl"),
        pki.issue("stranger", "someone"),
        other.issue("foreign", "tabbyctl"),
    )


def client(certs: Certs, pair: KeyPair | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    if pair is not None:
        ctx.load_cert_chain(str(pair.cert), str(pair.key))
    return ctx


def test_the_metrics_port_over_tls_checks_client_certificates(certs: Certs) -> None:
    tls = tls_context(str(certs.server.cert), str(certs.server.key), str(certs.ca))
    door = Door(client_cns=("tabbyctl",), local=lambda a: False)
    server = serve("127.0.0.1", 0, _endpoints(door), "test", tls)
    port = server.server_address[1]
    try:
        assert get(port, LOG, context=client(certs, certs.reader))[0] == 200
        assert get(port, LOG, context=client(certs, certs.stranger))[0] == 403
        assert get(port, LOG, context=client(certs, None))[0] == 401
        # /metrics needs no client certificate, only TLS
        assert get(port, "/metrics", context=client(certs, None))[0] == 200
        # a certificate of another CA: the handshake fails
        with pytest.raises((ssl.SSLError, ConnectionError)):
            get(port, LOG, context=client(certs, certs.foreign))
        # plain HTTP on the TLS port: no answer, and the server still serves
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            get(port, "/metrics")
        # a peer that never finishes its handshake holds only its own thread
        import socket

        idle = socket.create_connection(("127.0.0.1", port))
        try:
            assert get(port, "/metrics", context=client(certs, None))[0] == 200
        finally:
            idle.close()
    finally:
        stop([server])


def test_tabbyctl_reads_another_node_with_its_credentials(certs: Certs, tmp_path: Path) -> None:
    """tabbyctl's side: HTTPS with a client certificate, or a bearer token from a file."""
    flows = DeniedFlows(NODE)
    flows.add(
        time=1.0, src="10.0.0.1", dst="10.0.0.2", src_pod="a/b", dst_pod="c/d",
        protocol="TCP", dport=80, direction="ingress", policies=("c/deny",),
    )  # fmt: skip
    tls = tls_context(str(certs.server.cert), str(certs.server.key), str(certs.ca))
    door = Door(client_cns=("tabbyctl",), local=lambda a: False)
    server = serve("127.0.0.1", 0, _endpoints(door, flows), "test", tls)
    port = server.server_address[1]
    try:
        creds = Credentials(None, str(certs.reader.cert), str(certs.reader.key), str(certs.ca))
        answer = fetch(Source("127.0.0.1", port, "node-a", creds))
        assert [e["dst_pod"] for e in answer["entries"]] == ["c/d"]
        with pytest.raises(LogError, match=r"answered 401.*--token-file"):
            fetch(Source("127.0.0.1", port, "node-a", Credentials(ca_file=str(certs.ca))))
        stranger = Credentials(
            None, str(certs.stranger.cert), str(certs.stranger.key), str(certs.ca)
        )
        with pytest.raises(LogError, match="answered 403"):
            fetch(Source("127.0.0.1", port, "node-a", stranger))
        with pytest.raises(LogError, match="needs --ca-file"):
            Credentials(cert_file=str(certs.reader.cert)).context()
    finally:
        stop([server])
    token = tmp_path / "token"
    token.write_text("good\n")
    assert Credentials(str(token)).headers() == {"Authorization": "Bearer good"}
    with pytest.raises(LogError, match="cannot read the token"):
        Credentials(str(tmp_path / "none")).headers()


# -- options ---------------------------------------------------------------------------------------


def test_the_options_and_their_variables(tmp_path: Path) -> None:
    options, _ = parse([], {})
    assert options.metrics_cert_file is None
    assert options.log_client_cns == ("tabbyctl",)
    assert options.log_audiences == ("tabby-node",)
    env = {
        "TABBY_METRICS_CERT_FILE": "/etc/tabby/tls/tls.crt",
        "TABBY_METRICS_KEY_FILE": "/etc/tabby/tls/tls.key",
        "TABBY_METRICS_CLIENT_CA_FILE": "/etc/tabby/tls/ca.crt",
        "TABBY_POLICY_LOG_CLIENT_CN": "tabbyctl, ops",
        "TABBY_POLICY_LOG_AUDIENCE": "tabby-node,other",
    }
    options, _ = parse([], env)
    assert options.metrics_client_ca_file == "/etc/tabby/tls/ca.crt"
    assert options.log_client_cns == ("tabbyctl", "ops")
    assert options.log_audiences == ("tabby-node", "other")
    # the manifest's "" is unset
    options, _ = parse(["--metrics-cert-file", "", "--metrics-key-file", ""], {})
    assert options.metrics_cert_file is None
    from cni_protocol.errors import CniError

    with pytest.raises(CniError, match="go together"):
        parse(["--metrics-cert-file", "/x.crt"], {})
    with pytest.raises(CniError, match="needs --metrics-cert-file"):
        parse(["--metrics-client-ca-file", "/ca.crt"], {})
