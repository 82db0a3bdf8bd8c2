"""An in-memory Kubernetes API server for tests of tabby-kube-controllers without a real one.

What it does as the real API server does: collections with one global resourceVersion
counter; list (with ``limit``/``continue``) returns the collection's version; watch from a
version sends every later event of that collection, bookmarks on request, and a ``410 Gone``
(an ERROR event, or the status when the watch starts) for a version older than the
compacted one; get/create/update with optimistic concurrency (409 on a stale
resourceVersion or an existing name), ``uid`` and ``creationTimestamp`` set by the
server on create and kept on update; a cluster-wide pod collection (``/api/v1/pods``) over
the namespaced ones; tabby's kinds held to their CRDs' schemas (``stores.kube.crds``, applied
as the API server applies them: tests/structural.py): what a write does not declare is
dropped, what the schema refuses is a 422. What it adds for tests: :meth:`FakeApi.compact`
(forget history), :meth:`FakeApi.break_watches` (end every open watch, as a restart of the
API server does), :meth:`FakeApi.bookmark`, token and access reviews answered from
:attr:`FakeApi.tokens` and :attr:`FakeApi.grants`, :meth:`FakeApi.delete_definition` (a
CustomResourceDefinition deleted as the API server deletes one: marked, its objects deleted,
then it) and a request log. Serves HTTP on 127.0.0.1 only.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bundle.types import JSON
from stores.kube.crds import definitions, schema
from stores.kube.kinds import CRDS
from tests.structural import admit

CRD_COLLECTION = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
#: collection path -> (kind, namespaced)
COLLECTIONS = {
    "/api/v1/namespaces": ("Namespace", False),
    "/api/v1/nodes": ("Node", False),
    "/api/v1/pods": ("Pod", True),
    "/api/v1/serviceaccounts": ("ServiceAccount", True),
    "/apis/networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True),
    "/apis/coordination.k8s.io/v1/leases": ("Lease", True),
    "/apis/apps/v1/daemonsets": ("DaemonSet", True),
    "/api/v1/secrets": ("Secret", True),
    "/api/v1/endpoints": ("Endpoints", True),
    CRD_COLLECTION: ("CustomResourceDefinition", False),
    # tabby's CustomResourceDefinitions (cluster-scoped, but Calico's namespaced kinds)
    **{crd.path: (crd.kind, crd.namespaced) for crd in CRDS.values()},
}
TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
#: the audience a token has when it was made for the API server itself
API_AUDIENCE = "https://kubernetes.default.svc.cluster.local"
#: collection path -> its CRD's schema
SCHEMAS = {crd.path: schema(kind) for kind, crd in CRDS.items()}


class FakeApi:
    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.rv = 100
        self.compacted = 0
        self.objects: dict[str, dict[str, JSON]] = {c: {} for c in COLLECTIONS}
        self.history: dict[str, list[tuple[int, str, JSON]]] = {c: [] for c in COLLECTIONS}
        self.generation = 0  # break_watches() ends the watches of older generations
        self.requests: list[str] = []
        self.server: ThreadingHTTPServer | None = None
        #: answer every request 401 (the caller's token revoked, as an uninstall does)
        self.unauthorized = False
        #: collection -> an event a list of it waits for (hold_lists)
        self.list_gates: dict[str, threading.Event] = {}
        #: TokenReview: token -> (username, groups, its audiences)
        self.tokens: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {}
        #: SubjectAccessReview: (user or group, verb, group/resource/subresource, name)
        #: allowed ("*" as the name: every name)
        self.grants: set[tuple[str, str, str, str]] = set()
        for definition in definitions():  # tabby installed
            self.put(CRD_COLLECTION, definition)

    # -- state, for the tests -----------------------------------------------------------------

    def _key(self, obj: JSON) -> str:
        meta = obj["metadata"]
        return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else meta["name"]

    def put(self, collection: str, obj: JSON) -> JSON:
        """Create or replace (no concurrency check): what a user of kubectl would do."""
        with self.lock:
            obj = copy.deepcopy(obj)
            key = self._key(obj)
            existed = key in self.objects[collection]
            self.rv += 1
            meta = obj["metadata"]
            meta["resourceVersion"] = str(self.rv)
            meta.setdefault("uid", f"uid-{self.rv}")
            # the API server's own fields: set on create, kept on update
            meta["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            if existed:
                old = self.objects[collection][key]["metadata"]
                meta["uid"] = old["uid"]
                meta["creationTimestamp"] = old["creationTimestamp"]
            self.objects[collection][key] = obj
            self.history[collection].append((self.rv, "MODIFIED" if existed else "ADDED", obj))
            self.lock.notify_all()
            return copy.deepcopy(obj)

    def delete(self, collection: str, key: str) -> None:
        with self.lock:
            obj = self.objects[collection].pop(key)
            self.rv += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            self.history[collection].append((self.rv, "DELETED", obj))
            self.lock.notify_all()

    def delete_definition(self, kind: str, *, then: bool = True) -> None:
        """Delete tabby's CRD of store kind ``kind`` as the API server does: the definition
        marked (``deletionTimestamp``), every object of its kind deleted, then (``then``)
        the definition itself."""
        crd = CRDS[kind]
        marked = copy.deepcopy(self.objects[CRD_COLLECTION][crd.name])
        marked["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        self.put(CRD_COLLECTION, marked)
        for key in sorted(self.objects[crd.path]):
            self.delete(crd.path, key)
        if then:
            self.delete(CRD_COLLECTION, crd.name)

    def hold_lists(self, collection: str) -> threading.Event:
        """Lists of ``collection`` wait (10 s at most) until the returned event is set: the
        moment between one collection's list and another's."""
        gate = self.list_gates[collection] = threading.Event()
        return gate

    def compact(self) -> None:
        """Forget every event so far: a watch from an older version gets 410 Gone."""
        with self.lock:
            self.compacted = self.rv
            for events in self.history.values():
                events.clear()

    def break_watches(self) -> None:
        with self.lock:
            self.generation += 1
            self.lock.notify_all()

    def bookmark(self) -> None:
        """Advance the version without a change of any watched collection (then open
        watches with bookmarks get one)."""
        with self.lock:
            self.rv += 1
            self.lock.notify_all()

    def token_review(self, spec: JSON) -> JSON:
        """A TokenReview's status, as the API server's token authenticator answers: the
        token known, and of an audience asked for (none asked: the API server's own)."""
        known = self.tokens.get(str(spec.get("token")))
        wanted = tuple(spec.get("audiences") or (API_AUDIENCE,))
        if known is None:
            return {"authenticated": False, "error": "invalid bearer token"}
        user, groups, audiences = known
        common = [a for a in wanted if a in audiences]
        if not common:
            return {"authenticated": False, "error": "token audiences are invalid"}
        return {
            "authenticated": True,
            "user": {"username": user, "uid": f"uid-{user}", "groups": list(groups)},
            "audiences": common if spec.get("audiences") else [],
        }

    def access_review(self, spec: JSON) -> JSON:
        """A SubjectAccessReview's status from :attr:`grants` (resource attributes only)."""
        attrs = spec.get("resourceAttributes") or {}
        what = f"{attrs.get('group', '')}/{attrs.get('resource', '')}"
        if attrs.get("subresource"):
            what += f"/{attrs['subresource']}"
        subjects = [spec.get("user"), *(spec.get("groups") or ())]
        for subject in subjects:
            for name in (attrs.get("name", ""), "*"):
                if (subject, attrs.get("verb"), what, name) in self.grants:
                    return {"allowed": True}
        return {"allowed": False}

    # -- HTTP ---------------------------------------------------------------------------------

    def route(self, path: str) -> tuple[str, str | None, str | None]:
        """(collection, namespace, name) of a URL path."""
        parts = path.strip("/").split("/")
        for prefix, (_, _) in COLLECTIONS.items():
            pparts = prefix.strip("/").split("/")
            if parts[: len(pparts)] == pparts and len(parts) <= len(pparts) + 1:
                name = parts[len(pparts)] if len(parts) > len(pparts) else None
                return prefix, None, name
        # /api/v1/namespaces/<ns>/<plural>[/<name>], /apis/<g>/<v>/namespaces/<ns>/<plural>...
        if "namespaces" in parts:
            i = parts.index("namespaces")
            if len(parts) > i + 2:
                namespace, plural = parts[i + 1], parts[i + 2]
                name = parts[i + 3] if len(parts) > i + 3 else None
                collection = "/" + "/".join([*parts[:i], plural])
                if COLLECTIONS.get(collection, ("", False))[1]:
                    return collection, namespace, name
        raise KeyError(path)

    def serve(self) -> str:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # a response is not held back for an ACK

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _json(self, code: int, body: JSON) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _refused(self) -> bool:
                if api.unauthorized:
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                    self._json(401, {"kind": "Status", "reason": "Unauthorized", "code": 401})
                return api.unauthorized

            def _body(self) -> JSON:
                n = int(self.headers.get("Content-Length") or 0)
                data = json.loads(self.rfile.read(n) or b"{}")
                assert isinstance(data, dict)
                return data

            def _admitted(self, collection: str, obj: JSON) -> JSON | None:
                """``obj`` as its CRD's schema keeps it; None (and a 422 sent) when the
                schema refuses it."""
                found = SCHEMAS.get(collection)
                if found is None:
                    return obj
                kept, errors = admit(obj, found)
                if errors:
                    text = "; ".join(f"{path}: {why}" for path, why in errors)
                    self._json(422, _status(422, "Invalid", text))
                    return None
                return kept

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                api.requests.append(f"GET {url.path}{'?watch' if 'watch' in query else ''}")
                if self._refused():
                    return
                try:
                    collection, namespace, name = api.route(url.path)
                except KeyError:
                    self._json(404, _status(404, "NotFound", url.path))
                    return
                if name is not None:
                    key = f"{namespace}/{name}" if namespace else name
                    with api.lock:
                        obj = api.objects[collection].get(key)
                    if obj is None:
                        self._json(404, _status(404, "NotFound", key))
                    else:
                        self._json(200, obj)
                    return
                if query.get("watch") in ("true", "1"):
                    self._watch(collection, query)
                    return
                gate = api.list_gates.get(collection)
                if gate is not None:
                    gate.wait(10)
                with api.lock:
                    items = [
                        copy.deepcopy(o)
                        for k, o in sorted(api.objects[collection].items())
                        if namespace is None or k.startswith(namespace + "/")
                    ]
                    version = str(api.rv)
                limit = int(query.get("limit") or 0)
                start = int(query.get("continue") or 0)
                page = items[start : start + limit] if limit else items[start:]
                more = str(start + limit) if limit and start + limit < len(items) else ""
                meta = {"resourceVersion": version, **({"continue": more} if more else {})}
                self._json(200, {"kind": "List", "metadata": meta, "items": page})

            def _watch(self, collection: str, query: dict[str, str]) -> None:
                since = int(query.get("resourceVersion") or 0)
                bookmarks = query.get("allowWatchBookmarks") == "true"
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def send(event: JSON) -> None:
                    raw = json.dumps(event).encode() + b"\n"
                    self.wfile.write(f"{len(raw):x}\r\n".encode() + raw + b"\r\n")
                    self.wfile.flush()

                with api.lock:
                    generation = api.generation
                    if since < api.compacted:
                        send({"type": "ERROR", "object": _status(410, "Expired", "too old")})
                        self.wfile.write(b"0\r\n\r\n")
                        return
                sent = since
                try:
                    while True:
                        with api.lock:
                            if api.generation != generation:
                                break
                            events = [e for e in api.history[collection] if e[0] > sent]
                            out: list[JSON]
                            if events:
                                out = [{"type": t, "object": o} for _, t, o in events]
                                sent = events[-1][0]
                            elif bookmarks and api.rv > sent:
                                sent = api.rv
                                book = {"metadata": {"resourceVersion": str(sent)}}
                                out = [{"type": "BOOKMARK", "object": book}]
                            else:
                                api.lock.wait(0.2)
                                continue
                        for event in out:
                            send(event)
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    return

            def do_POST(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                api.requests.append(f"POST {url.path}")
                if self._refused():
                    return
                reviews = {TOKEN_REVIEWS: api.token_review, ACCESS_REVIEWS: api.access_review}
                if url.path in reviews:
                    review = self._body()
                    review["status"] = reviews[url.path](review.get("spec") or {})
                    self._json(201, review)
                    return
                collection, namespace, _ = api.route(url.path)
                admitted = self._admitted(collection, self._body())
                if admitted is None:
                    return
                obj = admitted
                obj["metadata"]["namespace"] = namespace or obj["metadata"].get("namespace")
                with api.lock:
                    if api._key(obj) in api.objects[collection]:
                        self._json(409, _status(409, "AlreadyExists", api._key(obj)))
                        return
                self._json(201, api.put(collection, obj))

            def do_DELETE(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                api.requests.append(f"DELETE {url.path}")
                if self._refused():
                    return
                collection, namespace, name = api.route(url.path)
                options = self._body()
                key = f"{namespace}/{name}" if namespace else str(name)
                with api.lock:
                    current = api.objects[collection].get(key)
                    if current is None:
                        self._json(404, _status(404, "NotFound", key))
                        return
                    wanted = (options.get("preconditions") or {}).get("resourceVersion")
                    if wanted is not None and wanted != current["metadata"]["resourceVersion"]:
                        self._json(409, _status(409, "Conflict", "precondition failed"))
                        return
                    api.delete(collection, key)
                self._json(200, _status(200, "Success", key))

            def do_PUT(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                api.requests.append(f"PUT {url.path}")
                if self._refused():
                    return
                collection, namespace, name = api.route(url.path)
                admitted = self._admitted(collection, self._body())
                if admitted is None:
                    return
                obj = admitted
                if namespace:
                    obj["metadata"]["namespace"] = namespace
                key = f"{namespace}/{name}" if namespace else str(name)
                with api.lock:
                    current = api.objects[collection].get(key)
                    if current is None:
                        self._json(404, _status(404, "NotFound", key))
                        return
                    given = obj.get("metadata", {}).get("resourceVersion")
                    if given != current["metadata"]["resourceVersion"]:
                        self._json(409, _status(409, "Conflict", "the object has been modified"))
                        return
                    self._json(200, api.put(collection, obj))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        # polled every 50 ms (not socketserver's 0.5 s): stop() returns as soon as it is asked
        serve = self.server.serve_forever
        threading.Thread(target=serve, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        if self.server is not None:
            self.break_watches()
            self.server.shutdown()
            self.server.server_close()


def _status(code: int, reason: str, message: str) -> JSON:
    return {
        "kind": "Status",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


@contextmanager
def fake_api() -> Iterator[tuple[FakeApi, str]]:
    api = FakeApi()
    url = api.serve()
    try:
        yield api, url
    finally:
        api.stop()


def namespace(name: str, labels: dict[str, str] | None = None) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": labels or {}},
    }


def pod(
    ns: str,
    name: str,
    labels: dict[str, str] | None = None,
    *,
    node: str = "node-1",
    ips: tuple[str, ...] = (),
    ports: tuple[tuple[str, int], ...] = (),
) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "c",
                    "image": "busybox",
                    "ports": [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports],
                }
            ],
        },
        "status": {"phase": "Running", "podIPs": [{"ip": ip} for ip in ips]},
    }


def policy(ns: str, name: str, spec: JSON) -> JSON:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }


def node(name: str, labels: dict[str, str] | None = None) -> JSON:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}}


def write_kubeconfig(path: str, url: str) -> str:
    """A kubeconfig file whose current context reaches ``url`` (a token, no TLS)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            "contexts: [{name: fake, context: {cluster: fake, user: fake}}]\n"
            f"clusters: [{{name: fake, cluster: {{server: '{url}'}}}}]\n"
            "users: [{name: fake, user: {token: fake-token}}]\n"
        )
    return path


def ready_node(name: str, labels: dict[str, str] | None = None, ready: bool = True) -> JSON:
    """A v1 Node with its Ready condition (the kubelet's liveness)."""
    obj = node(name, labels)
    obj["status"] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return obj
