"""``tabbyctl policy log``: the flows the kernel denied on this node, newest last.

They come from this node's tabby-node, which keeps the last 1,000 in memory
(``tabby_node.policylog``) and serves them on its health port, on 127.0.0.1 only:
``GET http://127.0.0.1:<health-port>/policy/log?since=N&wait=S``. ``--follow`` asks again
and again from the last entry seen, each request waiting up to 5 s for a new one, so a
denied flow is printed within a few hundred milliseconds of the packet.

``-n NS`` keeps the flows with a pod of namespace NS at either end, ``--pod POD`` those with
POD at either end (``NS/NAME``; a bare ``NAME`` is in ``-n``'s namespace, else
``default``). ``-o json`` prints one JSON object per line (``time, node, src, dst, src_pod,
dst_pod, protocol, dport, direction, verdict, policies``), also while following.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

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


def fetch(port: int, since: int = 0, wait: float = 0.0) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/policy/log?since={since}&wait={wait:g}"
    try:
        with urllib.request.urlopen(url, timeout=wait + 5) as r:
            data: dict[str, Any] = json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise LogError(
                f"tabby-node on 127.0.0.1:{port} keeps no policy log "
                "(started with --policy-visibility off, or older than this tabbyctl)"
            ) from None
        raise LogError(f"tabby-node on 127.0.0.1:{port} answered {e.code}") from None
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise LogError(
            f"no tabby-node answers on 127.0.0.1:{port} ({reason}): is it running on this "
            "node, with this --health-port?"
        ) from None
    return data


def pod_filter(namespace: str | None, pod: str | None) -> Callable[[dict[str, Any]], bool]:
    want_pod = None
    if pod is not None:
        want_pod = pod if "/" in pod else f"{namespace or 'default'}/{pod}"

    def keep(entry: dict[str, Any]) -> bool:
        ends = [p for p in (entry.get("src_pod"), entry.get("dst_pod")) if p]
        if namespace is not None and not any(p.split("/")[0] == namespace for p in ends):
            return False
        return want_pod is None or want_pod in ends

    return keep


def json_line(entry: dict[str, Any]) -> str:
    return json.dumps({k: entry.get(k) for k in FIELDS})


HEADER = ("TIME", "NODE", "DIRECTION", "PROTO", "SOURCE", "DESTINATION", "POLICIES")
WIDTHS = (24, 10, 9, 9, 34, 34)


def _end(pod: str | None, address: str) -> str:
    return f"{pod} ({address})" if pod else address


def row(entry: dict[str, Any]) -> tuple[str, ...]:
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
    port: int,
    *,
    follow: bool,
    keep: Callable[[dict[str, Any]], bool],
    output: str,
    echo: Callable[[str], None],
) -> None:
    """Print the ring (then, ``follow``, every new entry until interrupted)."""
    if output == "table":
        echo(line(HEADER))

    def emit(entries: Iterable[dict[str, Any]]) -> None:
        for e in entries:
            if keep(e):
                echo(json_line(e) if output == "json" else line(row(e)))

    answer = fetch(port)
    emit(answer["entries"])
    since = int(answer["next"])
    while follow:
        try:
            answer = fetch(port, since, FOLLOW_WAIT)
        except LogError as e:  # tabby-node restarting: say so, try again
            print(f"tabbyctl: {e}; trying again", file=sys.stderr)
            time.sleep(1.0)
            continue
        if int(answer["next"]) < since:  # a new tabby-node: its log starts afresh
            since = 0
            continue
        if int(answer["first"]) > since + 1:
            lost = int(answer["first"]) - since - 1
            print(f"tabbyctl: {lost} denied flows went by unseen", file=sys.stderr)
        emit(answer["entries"])
        since = int(answer["next"])


__all__ = ["FIELDS", "LogError", "fetch", "json_line", "line", "pod_filter", "row", "show"]
