"""A small client of the Kubernetes API: what tabby-kube-controllers need, and nothing else.

Why not a library (measured on the 2-core VM, docs/performance.md
"Measurements behind design choices"): the
official ``kubernetes`` client (37.0) costs 0.4-0.8 s to import, +33 MB RSS and 126 MB on disk
(the bundle and the image carry it), and only reports a ``410 Gone`` (the caller re-lists);
``lightkube`` silently loses the deletions of the gap when it restarts an expired watch, and
``kr8s`` retries an expired resourceVersion forever. The controllers need list, watch (from
a resourceVersion, with bookmarks, telling a ``410`` apart), get, create and update: a few
hundred lines over ``http.client`` and ``ssl``: ~60 ms to import and +9 MB, nearly all of
it the standard library's ``ssl`` and ``http.client``.

::

    config = KubeConfig.load(kubeconfig_path_or_None)   # or in-cluster (service account)
    api = KubeClient(config)
    items, rv = api.list("/api/v1/pods")
    for event in api.watch("/api/v1/pods", rv, stop):    # {"type": ..., "object": {...}}
        ...                                               # Gone: list again

Every failure is an :class:`ApiError` (``status`` 0: the server could not be reached).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import socket
import ssl
import tempfile
import threading
import time
import urllib.parse
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from bundle.types import JSON  # a Kubernetes object or response as the API sends it

#: Where a pod finds its service account (in-cluster configuration).
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
#: A list is read in pages of this many objects (one consistent snapshot: ``continue``).
PAGE = 500
#: A token file (a projected service account token rotates) is read again after this long.
TOKEN_REREAD_SECONDS = 60.0


class ApiError(Exception):
    """An answer other than success: ``status`` (0: no answer at all), the API's reason."""

    def __init__(self, status: int, reason: str, message: str = "") -> None:
        super().__init__(f"{status} {reason}: {message}" if message else f"{status} {reason}")
        self.status = status
        self.reason = reason
        self.message = message


class Gone(ApiError):
    """410: the resourceVersion is older than the API server keeps: list again."""


class Conflict(ApiError):
    """409: an update with a stale resourceVersion, or a create of an existing object."""


class NotFound(ApiError):
    """404."""


_BY_STATUS: dict[int, type[ApiError]] = {404: NotFound, 409: Conflict, 410: Gone}


def api_error(status: int, body: object, fallback: str = "") -> ApiError:
    """The error for a non-2xx answer (``body``: a v1 Status when the API sent one)."""
    reason, message = fallback or http.client.responses.get(status, "error"), ""
    if isinstance(body, Mapping):
        reason = str(body.get("reason") or reason)
        message = str(body.get("message") or "")
    return _BY_STATUS.get(status, ApiError)(status, reason, message)


# -- configuration --------------------------------------------------------------------------


@dataclass(frozen=True)
class KubeConfig:
    """How to reach and authenticate to one API server."""

    server: str  # https://host:port
    ca_file: str | None = None
    ca_data: str | None = None  # PEM
    insecure: bool = False
    cert_file: str | None = None
    key_file: str | None = None
    cert_data: bytes | None = None  # PEM
    key_data: bytes | None = field(default=None, repr=False)  # PEM; a secret
    token: str | None = field(default=None, repr=False)  # a secret
    token_file: str | None = None
    source: str = ""  # where it came from, for messages

    @classmethod
    def load(cls, path: str | None = None, env: Mapping[str, str] | None = None) -> KubeConfig:
        """``path`` (a kubeconfig: its current context), else ``$KUBECONFIG``, else the
        in-cluster service account when ``KUBERNETES_SERVICE_HOST`` is set."""
        env = os.environ if env is None else env
        path = path or env.get("KUBECONFIG") or None
        if path:
            return cls.from_kubeconfig(path)
        host = env.get("KUBERNETES_SERVICE_HOST")
        if host:
            port = env.get("KUBERNETES_SERVICE_PORT", "443")
            return cls(
                server=f"https://{_host_port(host, port)}",
                ca_file=os.path.join(SERVICE_ACCOUNT_DIR, "ca.crt"),
                token_file=os.path.join(SERVICE_ACCOUNT_DIR, "token"),
                source="the pod's service account",
            )
        raise ApiError(0, "no configuration", "give --kubeconfig, or run in a pod")

    @classmethod
    def from_kubeconfig(cls, path: str) -> KubeConfig:
        """A kubeconfig file: JSON (what ``tabbyctl node install`` writes for the plugins,
        read without importing a YAML parser on a CNI call), else YAML."""
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ApiError(0, "unreadable kubeconfig", f"{path}: {e}") from None
        try:
            doc = json.loads(text)
        except ValueError:
            import yaml

            try:
                doc = yaml.safe_load(text)
            except yaml.YAMLError as e:
                # where and what, never the parser's quote of the line (it may be a token's)
                mark = getattr(e, "problem_mark", None)
                where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
                what = getattr(e, "problem", None) or "not YAML"
                raise ApiError(0, "unreadable kubeconfig", f"{path}: {what}{where}") from None
        base = os.path.dirname(os.path.abspath(path))

        def named(section: str, name: object) -> JSON:
            for item in doc.get(section) or () if isinstance(doc, dict) else ():
                if isinstance(item, dict) and item.get("name") == name:
                    inner = item.get(section[:-1])
                    return inner if isinstance(inner, dict) else {}
            raise ApiError(0, "bad kubeconfig", f"{path}: no {section[:-1]} {name!r}")

        if not isinstance(doc, dict):
            raise ApiError(0, "bad kubeconfig", f"{path}: not a map")
        context = named("contexts", doc.get("current-context"))
        cluster = named("clusters", context.get("cluster"))
        user = named("users", context.get("user"))

        def file(value: object) -> str | None:
            if not isinstance(value, str) or not value:
                return None
            return value if os.path.isabs(value) else os.path.join(base, value)

        def data(value: object) -> bytes | None:
            return base64.b64decode(value) if isinstance(value, str) and value else None

        server = cluster.get("server")
        if not isinstance(server, str) or not server.startswith(("https://", "http://")):
            raise ApiError(0, "bad kubeconfig", f"{path}: the cluster has no server URL")
        ca = data(cluster.get("certificate-authority-data"))
        return cls(
            server=server.rstrip("/"),
            ca_file=file(cluster.get("certificate-authority")),
            ca_data=ca.decode() if ca else None,
            insecure=bool(cluster.get("insecure-skip-tls-verify")),
            cert_file=file(user.get("client-certificate")),
            key_file=file(user.get("client-key")),
            cert_data=data(user.get("client-certificate-data")),
            key_data=data(user.get("client-key-data")),
            token=user.get("token") if isinstance(user.get("token"), str) else None,
            token_file=file(user.get("tokenFile")),
            source=path,
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS context; ApiError (status 0) when its CA, certificate or key is unusable
        (named by what OpenSSL says, never by their content)."""
        try:
            return self._ssl_context()
        except (ssl.SSLError, OSError, ValueError) as e:
            why = getattr(e, "reason", None) or getattr(e, "strerror", None) or type(e).__name__
            raise ApiError(
                0, "bad kubeconfig", f"{self.source}: its CA, client certificate or key: {why}"
            ) from None

    def _ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file, cadata=self.ca_data)
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_file and self.key_file:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        elif self.cert_data and self.key_data:
            # ssl loads a client certificate from files only: written for the call, 0600.
            with tempfile.TemporaryDirectory(prefix="tabby-kube-") as tmp:
                cert, key = os.path.join(tmp, "cert"), os.path.join(tmp, "key")
                for where, content in ((cert, self.cert_data), (key, self.key_data)):
                    fd = os.open(where, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    with os.fdopen(fd, "wb") as f:
                        f.write(content)
                ctx.load_cert_chain(cert, key)
        return ctx


def _host_port(host: str, port: str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# -- the client -------------------------------------------------------------------------------


class KubeClient:
    """Thread-safe: each thread keeps one keep-alive connection for plain requests; each
    watch has a connection of its own, which :meth:`close` shuts down. A thread's request
    after :meth:`close` still works: on the connection close() closed, which it closes
    again when done (one made after close() is kept until the next close())."""

    def __init__(
        self, config: KubeConfig, *, timeout: float = 10.0, agent: str = "tabby-kube-controllers"
    ) -> None:
        self.config = config
        self.timeout = timeout
        self.agent = agent  #: the User-Agent: the API server counts requests by it
        url = urllib.parse.urlsplit(config.server)
        self._tls = url.scheme == "https"
        self._host = url.hostname or ""
        self._port = url.port or (443 if self._tls else 80)
        self._ctx = config.ssl_context() if self._tls else None
        self._local = threading.local()
        self._watches: set[socket.socket] = set()
        self._conns: set[http.client.HTTPConnection] = set()  # every thread's keep-alive one
        self._lock = threading.Lock()
        self._token: tuple[str, float] | None = None
        #: the token file's directory, held open: tabby-node re-reads the token in the
        #: thread of a CNI call it serves, which has entered the caller's (the host's) mount
        #: namespace, where the path means nothing; a rotated token replaces the file in it
        self._token_dir: int | None = None
        if config.token_file and not config.token:
            with contextlib.suppress(OSError):
                where = os.path.dirname(os.path.abspath(config.token_file))
                self._token_dir = os.open(where, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                weakref.finalize(self, os.close, self._token_dir)
        self.requests = 0  # requests sent (metrics, benches)

    # -- plumbing -------------------------------------------------------------------------

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        if self._tls:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=timeout, context=self._ctx
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _headers(self, body: bytes | None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": self.agent}
        token = self._bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if body is not None:
            headers["Content-Type"] = "application/json"
        return headers

    def _bearer(self) -> str | None:
        if self.config.token:
            return self.config.token
        if not self.config.token_file:
            return None
        with self._lock:
            now = time.monotonic()
            if self._token is None or now - self._token[1] > TOKEN_REREAD_SECONDS:
                try:
                    if self._token_dir is not None:
                        name = os.path.basename(self.config.token_file)
                        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self._token_dir)
                    else:
                        fd = os.open(self.config.token_file, os.O_RDONLY | os.O_CLOEXEC)
                    with open(fd, encoding="utf-8") as f:
                        self._token = (f.read().strip(), now)
                except OSError as e:
                    raise ApiError(0, "no service account token", str(e)) from None
            return self._token[0]

    @staticmethod
    def _path(path: str, params: Mapping[str, object] | None) -> str:
        if not params:
            return path
        query = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in params.items()}
        return f"{path}?{urllib.parse.urlencode(query)}"

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, object] | None = None,
        body: Mapping[str, object] | None = None,
    ) -> JSON:
        """One request on this thread's connection (opened again once if the server closed
        it); the decoded answer, or ApiError."""
        payload = json.dumps(body).encode() if body is not None else None
        target = self._path(path, params)
        for attempt in (0, 1):
            conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
            fresh = conn is None
            if conn is None:
                conn = self._local.conn = self._connect(self.timeout)
                with self._lock:
                    self._conns.add(conn)
            try:
                conn.request(method, target, body=payload, headers=self._headers(payload))
                response = conn.getresponse()
                raw = response.read()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                self._local.conn = None
                with self._lock:
                    self._conns.discard(conn)
                if attempt == 0 and not fresh and not isinstance(e, TimeoutError):
                    # a keep-alive connection the server had closed; not a timeout: a server
                    # that does not answer within it is unreachable (the call's bound is the
                    # timeout, not twice it)
                    continue
                raise ApiError(0, "API server unreachable", f"{self.config.server}: {e}") from None
            with self._lock:
                dropped = conn not in self._conns
            if dropped:
                # close() ran since this thread's connection was made, and http.client opened
                # it again for this request: closed now, as close() meant, not left open for
                # the garbage collector to find unclosed at some later moment
                conn.close()
                self._local.conn = None
            self.requests += 1
            try:
                decoded = json.loads(raw) if raw else {}
            except ValueError:
                decoded = {"message": raw[:200].decode(errors="replace")}
            if response.status >= 300:
                raise api_error(response.status, decoded)
            if not isinstance(decoded, dict):
                raise ApiError(response.status, "unexpected answer", repr(decoded)[:200])
            return decoded
        raise AssertionError("unreachable")  # pragma: no cover

    def get(self, path: str) -> JSON:
        return self.request("GET", path)

    def create(self, path: str, obj: Mapping[str, object]) -> JSON:
        return self.request("POST", path, body=obj)

    def update(self, path: str, obj: Mapping[str, object]) -> JSON:
        """PUT: fails with Conflict when ``metadata.resourceVersion`` is not the current."""
        return self.request("PUT", path, body=obj)

    def delete(self, path: str, *, resource_version: str | None = None) -> JSON:
        """DELETE; with ``resource_version``, only while the object is at that version
        (a precondition: Conflict otherwise)."""
        body: dict[str, object] | None = None
        if resource_version is not None:
            body = {
                "apiVersion": "v1",
                "kind": "DeleteOptions",
                "preconditions": {"resourceVersion": resource_version},
            }
        return self.request("DELETE", path, body=body)

    def list(
        self, path: str, *, params: Mapping[str, object] | None = None
    ) -> tuple[list[JSON], str]:
        """Every object at ``path`` (pages of PAGE, one snapshot) and the list's
        resourceVersion (what a watch starts from)."""
        items: list[JSON] = []
        token = ""
        while True:
            query: dict[str, object] = {**(params or {}), "limit": PAGE}
            if token:
                query["continue"] = token
            page = self.request("GET", path, params=query)
            items += [i for i in page.get("items") or () if isinstance(i, dict)]
            meta = page.get("metadata") or {}
            token = str(meta.get("continue") or "")
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    def watch(
        self,
        path: str,
        resource_version: str,
        stop: threading.Event,
        *,
        timeout_seconds: int = 300,
        params: Mapping[str, object] | None = None,
    ) -> Iterator[JSON]:
        """The changes after ``resource_version``: ``{"type": "ADDED" | "MODIFIED" |
        "DELETED" | "BOOKMARK", "object": {...}}``, bookmarks included (their object holds
        only the new resourceVersion). Ends when the server ends the watch (after
        ``timeout_seconds``), when ``stop`` is set and :meth:`close` is called, or raises:
        ``Gone`` when the version is too old, ``ApiError`` otherwise."""
        query = {
            **(params or {}),
            "watch": True,
            "resourceVersion": resource_version,
            "allowWatchBookmarks": True,
            "timeoutSeconds": timeout_seconds,
        }
        conn = self._connect(timeout_seconds + 30)
        try:
            try:
                conn.request("GET", self._path(path, query), headers=self._headers(None))
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                raise ApiError(0, "API server unreachable", f"{self.config.server}: {e}") from None
            self.requests += 1
            if response.status >= 300:
                raw = response.read()
                try:
                    body = json.loads(raw) if raw else {}
                except ValueError:
                    body = {}
                raise api_error(response.status, body)
            sock = conn.sock
            if sock is not None:
                with self._lock:
                    self._watches.add(sock)
            try:
                while not stop.is_set():
                    try:
                        line = response.readline()
                    except (OSError, http.client.HTTPException, ValueError):
                        if stop.is_set():
                            return
                        raise ApiError(0, "watch broken", path) from None
                    if not line:
                        return  # the server ended the watch (its timeout)
                    try:
                        event = json.loads(line)
                    except ValueError:
                        raise ApiError(0, "watch broken", f"{path}: not JSON") from None
                    if not isinstance(event, dict):
                        continue
                    if event.get("type") == "ERROR":
                        status = event.get("object") or {}
                        code = int(status.get("code") or 0) if isinstance(status, dict) else 0
                        raise api_error(code or 500, status)
                    yield event
            finally:
                if sock is not None:
                    with self._lock:
                        self._watches.discard(sock)
        finally:
            conn.close()

    def close(self) -> None:
        """Shut down every watch now (their iterators end) and every thread's connection."""
        with self._lock:
            watches = list(self._watches)
            conns = list(self._conns)
            self._conns.clear()
        for sock in watches:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for conn in conns:
            conn.close()
        self._local.conn = None
