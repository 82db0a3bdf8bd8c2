"""Who may read what names pods or flows (``/policy/log`` on the metrics port): the guard
``daemon.http`` asks before it serves a private route (docs/cluster.md "Who reads the
policy log", docs/kubernetes.md likewise).

* 127.0.0.1 and ::1: root on the node (and what shares its network namespace) reads it,
  as it can read the kernel's state anyway;
* a client certificate the metrics port's TLS verified against ``--metrics-client-ca-file``
  whose common name is one of ``--policy-log-client-cn``: allowed (another name: 403);
* a bearer token, where tabby-node reaches a Kubernetes API (its datastore's kubeconfig, or
  the pod's service account): the API server reviews it (a ``TokenReview`` for the
  audiences ``--policy-log-audience`` names), then authorizes the user it names (a
  ``SubjectAccessReview``: verb ``get`` on ``nodes/policylog`` of group ``tabby.io``, named
  as this node), as the kubelet does for its own endpoints. Unknown, expired or
  wrong-audience tokens: 401; known but not allowed: 403; the API server not answering:
  503, never open;
* anything else: 401.

The reviews are cached (:data:`CACHE_SECONDS`, at most :data:`CACHE_SIZE` tokens, by the
token's SHA-256), and at most :data:`CONCURRENT_REVIEWS` run at once (more waiting callers
get 503 after :data:`REVIEW_WAIT`): a scrape storm costs the API server a few requests, not
one per request. Every refusal is counted (``tabby_http_refusals_total{path, code}``).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from daemon.http import Caller
    from stores.kube.client import KubeClient

log = logging.getLogger("tabby.node")

#: The routes that name pods or flows, and the ``tabby.io`` subresource of ``nodes`` a
#: SubjectAccessReview asks about for each.
PRIVATE = {"/policy/log": "policylog"}
API_GROUP = "tabby.io"
RESOURCE = "nodes"
VERB = "get"
#: How long a review's answer is used (allowed or not), and how many tokens are remembered.
CACHE_SECONDS = 10.0
CACHE_SIZE = 256
#: Reviews in flight at once, and how long a caller waits for a turn before 503.
CONCURRENT_REVIEWS = 4
REVIEW_WAIT = 5.0
#: The API server's answer to one review, at most.
REVIEW_TIMEOUT = 5.0
#: A review the API server could not make is logged at most this often (each is counted).
WARN_EVERY = 30.0

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"  # noqa: S105 (a path)
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


class ReviewError(Exception):
    """The API server could not review (unreachable, or refused tabby-node the review)."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    code: int  # 200, 401, 403
    why: str


class TokenReviewer:
    """Bearer tokens reviewed by the Kubernetes API server (TokenReview, then
    SubjectAccessReview for ``node``'s subresource), answers cached."""

    def __init__(
        self,
        client: KubeClient,
        node: str,
        audiences: Sequence[str] = (),
        *,
        clock: Callable[[], float] = time.monotonic,
        ttl: float = CACHE_SECONDS,
        size: int = CACHE_SIZE,
    ) -> None:
        self.client = client
        self.node = node
        self.audiences = tuple(audiences)
        self.clock = clock
        self.ttl = ttl
        self.size = size
        self._cache: collections.OrderedDict[tuple[str, str], tuple[float, Verdict]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()
        self._turns = threading.BoundedSemaphore(CONCURRENT_REVIEWS)
        self.reviews = 0  # requests sent to the API server (tests, benches)

    def verdict(self, token: str, subresource: str) -> Verdict:
        """Allowed (200), not authenticated (401) or not allowed (403); ReviewError when
        the API server gives no answer."""
        key = (hashlib.sha256(token.encode()).hexdigest(), subresource)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > self.clock():
                self._cache.move_to_end(key)
                return hit[1]
        if not self._turns.acquire(timeout=REVIEW_WAIT):
            raise ReviewError("too many reviews in flight")
        try:
            verdict = self._review(token, subresource)
        finally:
            self._turns.release()
        with self._lock:
            self._cache[key] = (self.clock() + self.ttl, verdict)
            self._cache.move_to_end(key)
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        return verdict

    def _post(self, path: str, body: Mapping[str, object]) -> Mapping[str, object]:
        from stores.kube.client import ApiError

        self.reviews += 1
        try:
            answer = self.client.create(path, body)
        except ApiError as e:
            raise ReviewError(str(e)) from None
        status = answer.get("status")
        return status if isinstance(status, dict) else {}

    def _review(self, token: str, subresource: str) -> Verdict:
        spec: dict[str, object] = {"token": token}
        if self.audiences:
            spec["audiences"] = list(self.audiences)
        review = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": spec,
        }
        status = self._post(TOKEN_REVIEWS, review)
        user = status.get("user")
        if status.get("authenticated") is not True or not isinstance(user, dict):
            return Verdict(401, f"token not accepted: {status.get('error') or 'unknown token'}")
        granted = status.get("audiences")
        if self.audiences and not (
            isinstance(granted, list) and set(granted) & set(self.audiences)
        ):
            return Verdict(401, f"token not for audience {', '.join(self.audiences)}")
        name = str(user.get("username") or "")
        attributes = {
            "group": API_GROUP,
            "resource": RESOURCE,
            "subresource": subresource,
            "verb": VERB,
            "name": self.node,
        }
        access = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": name,
                "uid": str(user.get("uid") or ""),
                "groups": [str(g) for g in user.get("groups") or ()],
                "extra": user.get("extra") or {},
                "resourceAttributes": attributes,
            },
        }
        answer = self._post(ACCESS_REVIEWS, access)
        if answer.get("allowed") is True:
            return Verdict(200, f"{name} may get {RESOURCE}/{subresource}")
        return Verdict(
            403,
            f"{name} may not {VERB} {RESOURCE}/{subresource} ({API_GROUP}) of node {self.node}",
        )


def common_name(certificate: Mapping[str, object]) -> str | None:
    """The subject's common name of a certificate as ``ssl`` decodes it (``getpeercert()``:
    ``{"subject": ((("commonName", "x"),), ...)}``)."""
    subject = certificate.get("subject")
    for rdn in subject if isinstance(subject, tuple | list) else ():
        for pair in rdn if isinstance(rdn, tuple | list) else ():
            if isinstance(pair, tuple | list) and len(pair) == 2 and pair[0] == "commonName":
                return str(pair[1])
    return None


def loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


class Door:
    """The guard of the private routes (:data:`PRIVATE`): see the module's docstring.
    ``refused(path, code)`` counts each refusal; ``local(address)`` says whether a peer is
    on the node itself (root's)."""

    def __init__(
        self,
        *,
        client_cns: Sequence[str] = (),
        reviewer: TokenReviewer | None = None,
        refused: Callable[[str, int], None] | None = None,
        local: Callable[[str], bool] = loopback,
    ) -> None:
        self.client_cns = frozenset(client_cns)
        self.reviewer = reviewer
        self.refused = refused
        self.local = local
        self._warned = -WARN_EVERY

    def __call__(self, caller: Caller) -> tuple[int, str]:
        code, why = self._decide(caller)
        if code != 200:
            # counted, not logged at info: a storm of refusals must not flood the log
            log.debug("http: %s refused to %s: %d %s", caller.path, caller.address, code, why)
            if self.refused is not None:
                self.refused(caller.path, code)
        return code, why

    def _decide(self, caller: Caller) -> tuple[int, str]:
        if self.local(caller.address):
            return 200, "loopback"
        subresource = PRIVATE.get(caller.path)
        if subresource is None:
            return 403, f"{caller.path} is served on this node only"
        refusals: list[Verdict] = []
        if caller.certificate:
            cn = common_name(caller.certificate)
            if cn is not None and cn in self.client_cns:
                return 200, f"client certificate {cn}"
            refusals.append(Verdict(403, f"client certificate {cn!r} may not read {caller.path}"))
        scheme, _, token = (caller.authorization or "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            if self.reviewer is None:
                refusals.append(
                    Verdict(401, "bearer tokens are not reviewed here (no Kubernetes API)")
                )
            else:
                try:
                    verdict = self.reviewer.verdict(token.strip(), subresource)
                except ReviewError as e:
                    now = time.monotonic()
                    if now - self._warned > WARN_EVERY:  # once in a while, not per request
                        self._warned = now
                        log.warning("http: cannot review a token for %s: %s", caller.path, e)
                    return 503, f"cannot review the token now: {e}"
                if verdict.code == 200:
                    return 200, verdict.why
                refusals.append(verdict)
        if not refusals:
            return (
                401,
                f"{caller.path} names pods: authenticate (a bearer token or a client certificate)",
            )
        # authenticated by either credential but allowed by none: 403; else 401
        worst = max(refusals, key=lambda v: v.code)
        return worst.code, "; ".join(v.why for v in refusals)


def kube_client(kubeconfig: str | None) -> KubeClient | None:
    """A client of the Kubernetes API tabby-node can reach (its datastore's kubeconfig, else
    ``$KUBECONFIG`` or the pod's service account), for reviews; None when there is none."""
    from stores.kube.client import ApiError, KubeClient, KubeConfig

    try:
        config = KubeConfig.load(kubeconfig)
    except ApiError as e:
        log.info("http: bearer tokens are not reviewed: %s", e.message or e)
        return None
    return KubeClient(config, timeout=REVIEW_TIMEOUT, agent="tabby-node")


__all__ = [
    "PRIVATE",
    "Door",
    "ReviewError",
    "TokenReviewer",
    "Verdict",
    "common_name",
    "kube_client",
    "loopback",
]
