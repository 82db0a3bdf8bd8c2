"""``tabbyctl policy log``: the flows the kernel denied, newest last.

Every tabby-node keeps the last 1,000 in memory (``tabby_node.policylog``) and serves them
as ``GET /policy/log?since=N&wait=S``: on its health port (127.0.0.1 only), and beside
``/metrics`` on its metrics port (127.0.0.1 and the node's IPv4 address, where Prometheus
scrapes it), to 127.0.0.1 and to callers that authenticate (tabby_node.access). Without
``--node`` this node's are read from 127.0.0.1 (``--health-port``); ``--node N``
(repeatable) and ``--all-nodes`` read other nodes' from the address of their Node resource
on ``--metrics-port``, merged by time, with the :class:`Credentials` given: a bearer token
(``--token-file``: in Kubernetes, a service account token tabby-node reviews) and, over
HTTPS (``--ca-file``: the CA of the metrics port's certificate), a client certificate
(``--cert-file``, ``--key-file``). ``--follow`` asks again and again from
the last entry seen, each request waiting up to 5 s for a new one, so a denied flow is
printed within a few hundred milliseconds of the packet.

``-n NS`` keeps the flows with a pod of namespace NS at either end, ``--pod POD`` those with
POD at either end (``NS/NAME``; a bare ``NAME`` is in ``-n``'s namespace, else
``default``). ``-o json`` prints one JSON object per line (``time, node, src, dst, src_pod,
dst_pod, protocol, dport, direction, verdict, policies``), also while following.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import ssl
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable

from bundle.types import JSON

#: What one line of ``-o json`` holds, in this order.
FIELDS = (
    "time",
    "node",
    "src",
    "dst",
    "src_pod",
    "dst_pod",
    "protocol",
    "dport",
    "direction",
    "verdict",
    "policies",
)
FOLLOW_WAIT = 5.0


class LogError(Exception):
    """No answer to give (tabby-node not reachable, or without the log): one line."""


@dataclasses.dataclass(frozen=True)
class Credentials:
    """How tabbyctl authenticates to another node's metrics port: a bearer token (read
    from ``token_file`` at each request: a projected token rotates), and with ``ca_file``
    HTTPS, the server checked against it, with the client certificate ``cert_file`` (and
    ``key_file``) when given."""

    token_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.ca_file else "http"

    def headers(self) -> dict[str, str]:
        if not self.token_file:
            return {}
        try:
            with open(self.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise LogError(f"cannot read the token: {e}") from None
        return {"Authorization": f"Bearer {token}"}

    def context(self) -> ssl.SSLContext | None:
        if not self.ca_file:
            if self.cert_file:
                raise LogError("a client certificate needs --ca-file (HTTPS)")
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file:
                ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as e:
            raise LogError(f"cannot use the TLS files: {e}") from None
        return ctx


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one node's log is read: ``host:port``, what to call it in errors, and how to
    authenticate there."""

    host: str
    port: int
    what: str
    credentials: Credentials = Credentials()

    @property
    def hint(self) -> str:
        if self.host == "127.0.0.1":
            return "is it running on this node, with this --health-port?"
        return "does it run there, with this --metrics-port, reachable from here?"


def local(health_port: int) -> Source:
    return Source("127.0.0.1", health_port, f"tabby-node on 127.0.0.1:{health_port}")


def fetch(source: Source, since: int = 0, wait: float = 0.0) -> JSON:
    host = f"[{source.host}]" if ":" in source.host else source.host
    creds = source.credentials
    url = f"{creds.scheme}://{host}:{source.port}/policy/log?since={since}&wait={wait:g}"
    request = urllib.request.Request(url, headers=creds.headers())  # noqa: S310 (http(s) only)
    try:
        with urllib.request.urlopen(request, timeout=wait + 5, context=creds.context()) as r:  # noqa: S310
            data: JSON = json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise LogError(
                f"{source.what} keeps no policy log "
                "(started with --policy-visibility off, or older than this tabbyctl)"
            ) from None
        why = e.read().decode(errors="replace").strip()[:300]
        hint = ""
        if e.code == 401:
            hint = " (give --token-file, or --cert-file with --ca-file: docs/cluster.md)"
        raise LogError(f"{source.what} answered {e.code}: {why}{hint}") from None
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise LogError(f"no answer from {source.what} ({reason}): {source.hint}") from None
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        raise LogError(f"{source.what} answered something else than a policy log")
    return data


def pod_filter(namespace: str | None, pod: str | None) -> Callable[[JSON], bool]:
    want_pod = None
    if pod is not None:
        want_pod = pod if "/" in pod else f"{namespace or 'default'}/{pod}"

    def keep(entry: JSON) -> bool:
        ends = [p for p in (entry.get("src_pod"), entry.get("dst_pod")) if p]
        if namespace is not None and not any(p.split("/")[0] == namespace for p in ends):
            return False
        return want_pod is None or want_pod in ends

    return keep


def json_line(entry: JSON) -> str:
    return json.dumps({k: entry.get(k) for k in FIELDS})


HEADER = ("TIME", "NODE", "DIRECTION", "PROTO", "SOURCE", "DESTINATION", "POLICIES")
WIDTHS = (24, 10, 9, 9, 34, 34)


def _end(pod: str | None, address: str) -> str:
    return f"{pod} ({address})" if pod else address


def row(entry: JSON) -> tuple[str, ...]:
    proto = entry["protocol"] + (f"/{entry['dport']}" if entry.get("dport") else "")
    return (
        entry["time"],
        entry["node"],
        entry["direction"],
        proto,
        _end(entry.get("src_pod"), entry["src"]),
        _end(entry.get("dst_pod"), entry["dst"]),
        ", ".join(entry.get("policies") or ()) or "-",
    )


def line(cells: Iterable[str]) -> str:
    cells = list(cells)
    head = "  ".join(c.ljust(w) for c, w in zip(cells, WIDTHS, strict=False))
    return f"{head}  {cells[-1]}".rstrip()


def show(
    sources: list[Source],
    *,
    follow: bool,
    keep: Callable[[JSON], bool],
    output: str,
    echo: Callable[[str], None],
    until: threading.Event | None = None,
) -> None:
    """Print the rings, merged by time (then, ``follow``, every new entry as it comes,
    until interrupted or ``until`` is set)."""
    if output == "table":
        echo(line(HEADER))

    def emit(entries: Iterable[JSON]) -> None:
        for e in entries:
            if keep(e):
                echo(json_line(e) if output == "json" else line(row(e)))

    answers = [fetch(s) for s in sources]
    emit(sorted((e for a in answers for e in a["entries"]), key=lambda e: str(e["time"])))
    if not follow:
        return
    came: queue.Queue[list[JSON]] = queue.Queue()
    stop = until if until is not None else threading.Event()
    for source, answer in zip(sources, answers, strict=True):
        args = (source, int(answer["next"]), came, stop)
        threading.Thread(target=_follow, args=args, daemon=True).start()
    try:
        while not stop.is_set():
            try:
                emit(came.get(timeout=0.5))
            except queue.Empty:
                continue
    finally:
        stop.set()


def _follow(
    source: Source, since: int, came: queue.Queue[list[JSON]], stop: threading.Event
) -> None:
    """One node's new entries into ``came``, until ``stop``."""
    while not stop.is_set():
        try:
            answer = fetch(source, since, FOLLOW_WAIT)
        except LogError as e:  # tabby-node restarting: say so, try again
            print(f"tabbyctl: {e}; trying again", file=sys.stderr)
            stop.wait(1.0)
            continue
        if int(answer["next"]) < since:  # a new tabby-node: its log starts afresh
            since = 0
            continue
        if int(answer["first"]) > since + 1:
            lost = int(answer["first"]) - since - 1
            print(f"tabbyctl: {source.what}: {lost} denied flows went by unseen", file=sys.stderr)
        if answer["entries"]:
            came.put(answer["entries"])
        since = int(answer["next"])


__all__ = [
    "FIELDS",
    "Credentials",
    "LogError",
    "Source",
    "fetch",
    "json_line",
    "line",
    "local",
    "pod_filter",
    "row",
    "show",
]
