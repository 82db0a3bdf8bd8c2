"""``tabbyctl node status``: what this node's tabby-node has programmed, and BIRD's sessions.

Two sources, both under tabby-node's run directory (``--run-dir``, default ``/run/tabby``):

* ``status.json``, which tabby-node rewrites after every reconcile
  (``tabby_node.status.write_status``): node name, backend, node IP, the VXLAN endpoints
  it programmed, and its own problems;
* BIRD's control socket ``bird.ctl`` (backend ``bird``), asked live for the state of every
  configured BGP session (``bird.read_peers``).

No status file means no tabby-node runs with that run directory: one line, exit 1, nothing
printed. Otherwise the status is printed, and the command still exits 1 with one line on
stderr when the picture is incomplete: BIRD does not answer (the peers the status file last
listed are shown with state ``unknown`` and no ``since``), or the file is stale (not
rewritten for three resync periods, 90 s: its tabby-node stopped, or its loop is stuck).
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import click

from bundle.types import JSON

if TYPE_CHECKING:
    from bird import PeerStatus

from tabbyctl.common import output_option, run_dir_option

UNKNOWN = "unknown"
#: A live "since" this close to the one tabby-node last recorded for the same session in the
#: same state is the same event: the recorded string is shown, so the value stays stable.
SINCE_TOLERANCE_SECONDS = 2.0
BIRD_TIMEOUT_SECONDS = 3.0
#: tabby-node rewrites its status after every reconcile, and reconciles at least every
#: ``tabby_node.status.RESYNC_SECONDS``: a file older than this many of those periods is stale.
STALE_PERIODS = 3


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _live_peers(ctl: str) -> list[PeerStatus]:
    from bird import read_peers

    return list(read_peers(ctl, timeout=BIRD_TIMEOUT_SECONDS))


def _iso(ts: object) -> str | None:
    if not isinstance(ts, int | float):
        return None
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_iso(text: object) -> dt.datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    except ValueError:
        return None


def _peer_row(p: Mapping[str, object]) -> JSON:
    """The contract's four keys first, then what else is known."""
    row: JSON = {
        "address": str(p.get("address", "")),
        "type": str(p.get("type", "")),
        "state": str(p.get("state", "")),
        "since": str(p.get("since") or ""),
    }
    row.update({k: v for k, v in p.items() if k not in row})
    return row


def _stable_since(live: JSON, recorded: list[Mapping[str, object]]) -> None:
    """Keep the string tabby-node recorded for this session when BIRD's value is the same
    event (BIRD recomputes "since" at every query; it jitters across a second boundary)."""
    now = _parse_iso(live["since"])
    if now is None:
        return
    for r in recorded:
        if r.get("protocol") != live.get("protocol") or r.get("state") != live["state"]:
            continue
        then = _parse_iso(r.get("since"))
        if then is not None and abs((now - then).total_seconds()) <= SINCE_TOLERANCE_SECONDS:
            live["since"] = str(r["since"])
        return


def _vxlan_row(v: Mapping[str, object]) -> JSON:
    row: JSON = {
        "node": str(v.get("node") or ""),
        "address": str(v.get("address") or ""),
        "tunnel_address": str(v.get("tunnel_address") or ""),
        "mac": str(v.get("mac") or ""),
    }
    row.update({k: val for k, val in v.items() if k not in row})
    return row


def node_status(
    run_dir: str,
    *,
    read_peers: Callable[[str], list[PeerStatus]] | None = None,
    pid_alive: Callable[[int], bool] = _pid_alive,
    clock: Callable[[], float] = time.time,
) -> tuple[JSON, list[str]]:
    """The status of the tabby-node that uses ``run_dir`` and the problems that make it
    incomplete (empty: complete). Raises ``CtlError`` when there is no status at all.

    ``read_peers(ctl_path)`` defaults to ``bird.read_peers`` (live BIRD).
    """
    from bird import CTL_NAME, BirdError
    from tabby_node.status import RESYNC_SECONDS, STATUS_FILE, read_status
    from tabbyctl.views import CtlError

    path = os.path.join(run_dir, STATUS_FILE)
    if not os.path.lexists(path):
        raise CtlError(
            f"no tabby-node runs here: {path} does not exist "
            "(start tabby-node, or give the --run-dir it uses)"
        )
    if not os.access(path, os.R_OK):
        raise CtlError(f"permission denied: {path}: run tabbyctl as root")
    status = read_status(run_dir)
    if status is None:
        raise CtlError(f"{path} is not a tabby-node status (unreadable or not a JSON object)")

    problems: list[str] = []
    pid = status.get("pid")
    updated = status.get("updated")
    written = _iso(updated)
    # Judged by age, not by the pid alone: tabbyctl may run in another pid namespace (on
    # the host, tabby-node in a container), where the pid means nothing.
    age = clock() - updated if isinstance(updated, int | float) else None
    if age is not None and age > STALE_PERIODS * RESYNC_SECONDS:
        if isinstance(pid, int) and not pid_alive(pid):
            why = f"tabby-node (pid {pid}) is not running"
        else:
            why = f"tabby-node (pid {pid}) has not rewritten it for {age:.0f} s"
        problems.append(f"{path} is stale (written {written}): {why}")
    backend = str(status.get("backend") or "")
    recorded = [p for p in status.get("peers") or [] if isinstance(p, Mapping)]
    bird: JSON = {}
    if isinstance(status.get("bird"), Mapping):
        bird.update(status["bird"])
    if backend == "bird":
        ctl = os.path.join(run_dir, CTL_NAME)
        try:
            peers = [_peer_row(p.as_dict()) for p in (read_peers or _live_peers)(ctl)]
        except (BirdError, OSError) as e:
            reason = str(e).removeprefix(f"BIRD control socket {ctl}: ")
            problems.append(f"BIRD does not answer on {ctl}: {reason}")
            peers = [
                {**_peer_row(p), "state": UNKNOWN, "since": "", "last_known_state": p.get("state")}
                for p in recorded
            ]
            bird["answered"] = False
        else:
            for p in peers:
                _stable_since(p, recorded)
            bird["answered"] = True
    else:
        peers = [_peer_row(p) for p in recorded]
    data: JSON = {
        "node": status.get("node"),
        "backend": backend,
        "node_ip": status.get("node_ip"),
        "peers": peers,
        "vxlan": [_vxlan_row(v) for v in status.get("vxlan") or [] if isinstance(v, Mapping)],
        "node_ip6": status.get("node_ip6"),
        "mtu": status.get("mtu"),
        "ipip": status.get("ipip"),
        "problems": status.get("problems") or {},
        "routing_problems": status.get("routing_problems") or [],
        "pid": pid,
        "updated": written,
        "run_dir": run_dir,
    }
    if bird:
        data["bird"] = bird
    if problems:
        data["errors"] = problems
    return data, problems


def status_lines(data: JSON) -> list[str]:
    """The table form of :func:`node_status`."""
    from tabbyctl.views import table

    lines = table(
        ["FIELD", "VALUE"],
        [
            ["NODE", data.get("node")],
            ["BACKEND", data.get("backend")],
            ["NODE IP", data.get("node_ip")],
            ["NODE IPV6", data.get("node_ip6")],
            ["MTU", data.get("mtu")],
            ["UPDATED", f"{data.get('updated') or '-'} by tabby-node pid {data.get('pid')}"],
        ],
    )
    ipip = data.get("ipip")
    if isinstance(ipip, Mapping) and ipip.get("available") is False and ipip.get("reason"):
        lines.append(f"IP-in-IP unavailable: {ipip['reason']}")
    if data.get("backend") == "bird":
        lines.append("")
        if data["peers"]:
            lines += table(
                ["PEER ADDRESS", "TYPE", "STATE", "SINCE", "INFO"],
                [
                    [p["address"], p["type"], p["state"], p["since"] or None, p.get("info") or None]
                    for p in data["peers"]
                ],
            )
        elif (data.get("bird") or {}).get("answered") is False:
            lines.append("BGP peers unknown: BIRD does not answer")
        else:
            lines.append("no BGP peers configured")
    if data["vxlan"]:
        lines.append("")
        lines += table(
            ["VXLAN NODE", "ADDRESS", "TUNNEL ADDRESS", "MAC", "DEVICE"],
            [
                [
                    v["node"] or None,
                    v["address"],
                    v["tunnel_address"] or None,
                    v["mac"],
                    v.get("device"),
                ]
                for v in data["vxlan"]
            ],
        )
    elif data.get("backend") == "vxlan":
        lines += ["", "no VXLAN endpoints programmed"]
    reported = [f"{k}: {v}" for k, v in sorted(data["problems"].items())]
    reported += [str(p) for p in data["routing_problems"]]
    if reported:
        lines.append("")
        lines += [f"problem: {p}" for p in reported]
    return lines


@click.command("status")
@run_dir_option
@output_option
def status_cmd(run_dir: str, output: str) -> None:
    """This node's backend, node IP, BGP sessions (live from BIRD) and VXLAN endpoints.

    Exit 1 with one line on stderr when no tabby-node runs here, when BIRD does not answer
    (peers shown as unknown) or when the status file is stale.
    """
    from tabbyctl.common import emit, operator_errors

    with operator_errors():
        data, problems = node_status(run_dir)
    emit(output, data, status_lines(data))
    if problems:
        raise click.ClickException("; ".join(problems))
