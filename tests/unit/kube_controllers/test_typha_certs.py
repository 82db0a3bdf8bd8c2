"""tabby-typha's certificates made by the controllers (``kube_controllers.typha_certs``)
against the in-memory API server: the three Secrets made once, by whichever replica comes
first (the others read them), a leaf near its end or of another CA renewed under the same
CA, a Secret that is not tabby's left alone; and the minted pair works: typha's server
with the server Secret accepts a node with the client Secret and checks its CN, and the
node checks typha's name."""

from __future__ import annotations

import base64
import datetime
import threading
from collections.abc import Iterator

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from datastore.base import Doc
from fanout import server
from fanout.client import ClientTls, TyphaSync
from kube_controllers import typha_certs as tc
from stores.kube.client import KubeClient, KubeConfig
from tests.kube_fake import FakeApi, fake_api
from tests.unit.fanout.docs import pod
from tests.unit.fanout.test_stream import Consumer, Loop, start, started_hub

NS = "tabby-system"
SECRETS = "/api/v1/secrets"


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, KubeClient]]:
    with fake_api() as (fake, url):
        client = KubeClient(KubeConfig(server=url), timeout=5.0)
        yield fake, client
        client.close()


def secret(fake: FakeApi, name: str) -> dict[str, bytes]:
    obj = fake.objects[SECRETS][f"{NS}/{name}"]
    return {k: base64.b64decode(v) for k, v in obj["data"].items()}


def cert(pem: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem)


def test_made_once_each_leaf_signed_by_the_ca_and_naming_its_peer(
    api: tuple[FakeApi, KubeClient],
) -> None:
    fake, client = api
    assert tc.ensure(client, NS) == [f"{n} made" for n in tc.SECRETS]
    ca = cert(secret(fake, tc.CA_SECRET)["ca.crt"])
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for leaf, usage in (
        (tc.LEAVES[0], ExtendedKeyUsageOID.SERVER_AUTH),
        (tc.LEAVES[1], ExtendedKeyUsageOID.CLIENT_AUTH),
    ):
        data = secret(fake, leaf.secret)
        assert set(data) == {"ca.crt", "tls.crt", "tls.key"}
        assert data["ca.crt"] == secret(fake, tc.CA_SECRET)["ca.crt"]
        c = cert(data["tls.crt"])
        c.verify_directly_issued_by(ca)
        assert c.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == leaf.name
        sans = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.DNSName) == [leaf.name]
        assert list(c.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [usage]
        days = (c.not_valid_after_utc - c.not_valid_before_utc).days
        assert days == tc.LEAF_DAYS
        assert "ca.key" not in data  # the CA's key stays in the CA's Secret
    assert fake.objects[SECRETS][f"{NS}/{tc.SERVER_SECRET}"]["type"] == "kubernetes.io/tls"
    versions = {k: o["metadata"]["resourceVersion"] for k, o in fake.objects[SECRETS].items()}
    assert tc.ensure(client, NS) == []  # a second replica, a restart: nothing written
    assert versions == {
        k: o["metadata"]["resourceVersion"] for k, o in fake.objects[SECRETS].items()
    }


def test_replicas_starting_together_agree_on_one_ca(api: tuple[FakeApi, KubeClient]) -> None:
    fake, client = api
    url = client.config.server
    done: list[list[str]] = []

    def replica() -> None:
        own = KubeClient(KubeConfig(server=url), timeout=5.0)
        try:
            done.append(tc.ensure(own, NS))
        finally:
            own.close()

    threads = [threading.Thread(target=replica) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert len(done) == 4
    made = sorted(x for d in done for x in d)
    assert made == sorted(f"{n} made" for n in tc.SECRETS)  # each made by one replica
    ca = cert(secret(fake, tc.CA_SECRET)["ca.crt"])
    for leaf in tc.LEAVES:
        cert(secret(fake, leaf.secret)["tls.crt"]).verify_directly_issued_by(ca)


def test_a_leaf_near_its_end_or_of_another_ca_is_renewed_under_the_same_ca(
    api: tuple[FakeApi, KubeClient],
) -> None:
    fake, client = api
    tc.ensure(client, NS)
    ca = secret(fake, tc.CA_SECRET)
    old = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=tc.LEAF_DAYS - 30)
    server_leaf, client_leaf = tc.LEAVES
    ending, key = tc.make_leaf(ca["ca.crt"], ca["ca.key"], server_leaf, now=old)
    assert tc.leaf_problem(ca["ca.crt"], ending, server_leaf) is not None
    other_ca, other_key = tc.make_ca()
    foreign, fkey = tc.make_leaf(other_ca, other_key, client_leaf)
    for leaf, pem, k in ((server_leaf, ending, key), (client_leaf, foreign, fkey)):
        obj = fake.objects[SECRETS][f"{NS}/{leaf.secret}"]
        obj["data"]["tls.crt"] = base64.b64encode(pem).decode()
        obj["data"]["tls.key"] = base64.b64encode(k).decode()
    done = tc.ensure(client, NS)
    assert [d.split(" (")[0] for d in done] == [f"{n} renewed" for n in tc.SECRETS[1:]]
    assert "not signed by the CA" in done[1]
    for leaf in tc.LEAVES:
        now = secret(fake, leaf.secret)
        assert tc.leaf_problem(ca["ca.crt"], now["tls.crt"], leaf) is None
    assert secret(fake, tc.CA_SECRET) == ca  # the CA is kept: running pairs go on


def test_a_secret_that_is_not_tabbys_is_left_alone(api: tuple[FakeApi, KubeClient]) -> None:
    fake, client = api
    meta = {"name": tc.CA_SECRET, "namespace": NS}
    fake.put(SECRETS, {"kind": "Secret", "metadata": meta, "data": {"x": ""}})
    with pytest.raises(tc.CertError, match="lacks"):
        tc.ensure(client, NS)
    assert set(fake.objects[SECRETS]) == {f"{NS}/{tc.CA_SECRET}"}


def test_the_minted_pair_serves_mutual_tls_with_the_names_checked(
    api: tuple[FakeApi, KubeClient],
) -> None:
    fake, client = api
    tc.ensure(client, NS)
    srv_data, cli_data = secret(fake, tc.SERVER_SECRET), secret(fake, tc.CLIENT_SECRET)
    loop = Loop()
    try:
        hub = started_hub(loop, "e1", {"default/a": Doc(pod("a", "n1"), 1)})
        tls = server.Tls(
            srv_data["ca.crt"],
            srv_data["tls.crt"],
            srv_data["tls.key"],
            client_cns=(tc.CLIENT_NAME,),
        )
        srv = start(loop, hub, tls)
        address = [f"127.0.0.1:{srv.port}"]
        good = ClientTls(
            cli_data["ca.crt"], cli_data["tls.crt"], cli_data["tls.key"], tc.SERVER_NAME
        )
        node = Consumer(TyphaSync(address, "n2", good))
        try:
            node.wait(lambda e: len(e) == 1 and e[0].type == "snapshot")
        finally:
            node.close()
        # a client certificate of the same CA with another CN: refused and counted
        ca = secret(fake, tc.CA_SECRET)
        intruder, ikey = tc.make_leaf(ca["ca.crt"], ca["ca.key"], tc.Leaf("x", "intruder", False))
        wrong = ClientTls(ca["ca.crt"], intruder, ikey, tc.SERVER_NAME)
        source = TyphaSync(address, "n3", wrong, backoff=(0.05, 0.2))
        refused = Consumer(source)
        try:
            refused.wait(lambda _: "PERMISSION_DENIED" in (source.last_error or ""))
        finally:
            refused.close()
        assert hub.stats.refused["identity"] >= 1
        # a node that expects another name of typha refuses typha's certificate
        other = ClientTls(
            cli_data["ca.crt"], cli_data["tls.crt"], cli_data["tls.key"], "typha.example"
        )
        source = TyphaSync(address, "n4", other, backoff=(0.05, 0.2))
        mistrust = Consumer(source)
        try:
            mistrust.wait(lambda _: bool(source.last_error))
            assert not mistrust.events
        finally:
            mistrust.close()
        loop.run(srv.stop(None))
    finally:
        loop.close()
