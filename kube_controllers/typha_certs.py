"""tabby-typha's mutual TLS, provisioned by the install itself (``--typha-certs NAMESPACE``):
every replica of the controllers ensures, when it starts and every 12 h, three Secrets in
that namespace, each created only if absent (a 409 means another replica made it first:
that one is read and used):

- ``tabby-typha-ca``: the CA (``ca.crt``, ``ca.key``), read by the controllers alone (their
  Role names it; no pod mounts it). The key is kept, not discarded, so that a leaf is
  renewed under the same CA: typha and tabby-node pods started before and after a renewal
  still trust each other.
- ``tabby-typha-server``: ``ca.crt``, ``tls.crt``/``tls.key`` with CN and DNS SAN
  ``tabby-typha`` (what tabby-node's ``--typha-cn`` checks); mounted by typha's pods only.
- ``tabby-typha-client``: ``ca.crt``, ``tls.crt``/``tls.key`` with CN ``tabby-node`` (what
  typha's ``--client-cn`` allows); mounted by tabby-node's pods only.

Lifetimes: the CA 10 years, each leaf 1 year; a leaf within 60 days of its end (or not
signed by the CA, or not naming what it must) is minted again and written with the
Secret's resourceVersion (a 409: another replica renewed it; read again). The kubelet
updates the mounted files within a minute or so; typha and tabby-node read them when they
start, so a renewed leaf is used from the pods' next start (docs/kubernetes.md). The CA is
not renewed (a new CA would cut every running pair).
"""

from __future__ import annotations

import base64
import datetime
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey

    from bundle.types import JSON
    from stores.kube.client import KubeClient

log = logging.getLogger("tabby.controllers")

#: the Secrets' names (names, not secrets)
CA_SECRET = "tabby-typha-ca"  # noqa: S105
SERVER_SECRET = "tabby-typha-server"  # noqa: S105
CLIENT_SECRET = "tabby-typha-client"  # noqa: S105
SECRETS = (CA_SECRET, SERVER_SECRET, CLIENT_SECRET)
#: the names typha's and tabby-node's certificates carry (--typha-cn, --client-cn)
SERVER_NAME = "tabby-typha"
CLIENT_NAME = "tabby-node"
CA_DAYS = 3650
LEAF_DAYS = 365
RENEW_BEFORE = datetime.timedelta(days=60)
CHECK_EVERY = 12 * 3600.0


@dataclass(frozen=True)
class Leaf:
    secret: str
    name: str
    server: bool  # a server's certificate (serverAuth), else a client's (clientAuth)


LEAVES = (Leaf(SERVER_SECRET, SERVER_NAME, True), Leaf(CLIENT_SECRET, CLIENT_NAME, False))


class CertError(Exception):
    """A Secret that exists but cannot be used (not tabby's, or damaged): left alone."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key() -> EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _name(cn: str) -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(now: datetime.datetime | None = None) -> tuple[bytes, bytes]:
    """A new CA: (certificate PEM, key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    now = now or _now()
    key = _key()
    subject = _name("tabby-typha-ca")
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    return _pem_cert(cert), _pem_key(key)


def make_leaf(
    ca_pem: bytes, ca_key_pem: bytes, leaf: Leaf, now: datetime.datetime | None = None
) -> tuple[bytes, bytes]:
    """A certificate of ``leaf.name`` (CN and DNS SAN) signed by the CA: (cert PEM, key PEM)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    now = now or _now()
    ca = x509.load_pem_x509_certificate(ca_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise CertError(f"{CA_SECRET}: ca.key is not an EC key")
    key = _key()
    usage = ExtendedKeyUsageOID.SERVER_AUTH if leaf.server else ExtendedKeyUsageOID.CLIENT_AUTH
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(leaf.name))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, False, False, False, False),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(leaf.name)]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _pem_cert(cert), _pem_key(key)


def leaf_problem(
    ca_pem: bytes, cert_pem: bytes, leaf: Leaf, now: datetime.datetime | None = None
) -> str | None:
    """Why ``cert_pem`` must be minted again (None: it serves): not of this CA, not naming
    ``leaf.name``, or within RENEW_BEFORE of its end."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.x509.oid import NameOID

    now = now or _now()
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as e:
        return f"unreadable: {e}"
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError) as e:
        return f"not signed by the CA ({type(e).__name__})"
    cns = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if cns != [leaf.name]:
        return f"CN {cns}, not {leaf.name}"
    left = cert.not_valid_after_utc - now
    if left < RENEW_BEFORE:
        return f"ends {cert.not_valid_after_utc:%Y-%m-%d}"
    return None


# -- the Secrets ---------------------------------------------------------------------------------


def _path(namespace: str, name: str = "") -> str:
    base = f"/api/v1/namespaces/{namespace}/secrets"
    return f"{base}/{name}" if name else base


def _secret(namespace: str, name: str, kind: str, data: dict[str, bytes]) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/part-of": "tabby"},
        },
        "type": kind,
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
    }


def _data(obj: JSON, *keys: str) -> dict[str, bytes]:
    data = obj.get("data") or {}
    name = (obj.get("metadata") or {}).get("name")
    try:
        return {k: base64.b64decode(data[k]) for k in keys}
    except (KeyError, TypeError, ValueError) as e:
        why = f"Secret {name} lacks {e}: not tabby's? (delete it to have it made)"
        raise CertError(why) from None


def _get_or_create(api: KubeClient, namespace: str, make: JSON) -> tuple[JSON, bool]:
    """The Secret named in ``make``, created if absent; (it, whether this call made it)."""
    from stores.kube.client import Conflict, NotFound

    name = make["metadata"]["name"]
    try:
        return api.get(_path(namespace, name)), False
    except NotFound:
        pass
    try:
        return api.create(_path(namespace), make), True
    except Conflict:  # another replica made it between the two calls
        return api.get(_path(namespace, name)), False


def ensure(api: KubeClient, namespace: str) -> list[str]:
    """The three Secrets there and usable; what was made or renewed (for the log)."""
    from stores.kube.client import Conflict

    done: list[str] = []
    ca_pem, ca_key_pem = make_ca()
    obj, made = _get_or_create(
        api,
        namespace,
        _secret(namespace, CA_SECRET, "Opaque", {"ca.crt": ca_pem, "ca.key": ca_key_pem}),
    )
    if made:
        done.append(f"{CA_SECRET} made")
    got = _data(obj, "ca.crt", "ca.key")
    ca_pem, ca_key_pem = got["ca.crt"], got["ca.key"]
    for leaf in LEAVES:
        for _ in range(3):
            cert, key = make_leaf(ca_pem, ca_key_pem, leaf)
            fresh = {"ca.crt": ca_pem, "tls.crt": cert, "tls.key": key}
            wanted = _secret(namespace, leaf.secret, "kubernetes.io/tls", fresh)
            obj, made = _get_or_create(api, namespace, wanted)
            if made:
                done.append(f"{leaf.secret} made")
                break
            have = _data(obj, "ca.crt", "tls.crt")
            why = leaf_problem(ca_pem, have["tls.crt"], leaf)
            if why is None and have["ca.crt"] == ca_pem:
                break
            why = why or "another CA certificate"
            wanted["metadata"]["resourceVersion"] = obj["metadata"]["resourceVersion"]
            try:
                api.update(_path(namespace, leaf.secret), wanted)
            except Conflict:  # another replica renewed it first: read it again
                continue
            done.append(f"{leaf.secret} renewed ({why})")
            break
    return done
