"""A client of BIRD's control socket, and what ``node status`` and readiness make of it.

BIRD's control protocol (``doc/reply_codes`` in BIRD's source): the server greets with
``0001 BIRD <version> ready.``; a command is one line; every reply line starts with a
four-digit code followed by ``-`` (more lines follow) or a space (the reply's last line), or
is a single space followed by a continuation of the previous line's code. ``+`` lines are
spontaneous messages. Codes 0xxx succeed, 1xxx are table rows, 2xxx table headings, 8xxx
run-time errors, 9xxx parse errors. Speaking it directly costs a connect and a read (no
``birdc`` process per call).

Times: the rendered configuration makes BIRD print them as ``%Y-%m-%dT%H:%M:%S.%6f%z``.
BIRD recomputes a protocol's "since" from its monotonic clock at every query, so the value
jitters by microseconds (and drifts with clock slews); :class:`SinceMemo` keeps the reported
second stable while a session stays in the same state.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import socket
import struct
from collections.abc import Iterable, Mapping, Sequence

from bird.model import PeerType
from bird.render import parse_protocol_name
from bundle.types import IPAddress

_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%f%z"
_MAX_LINE = 1 << 16
_PEERCRED = struct.Struct("3i")

#: BGP state when a session is up.
ESTABLISHED = "Established"
#: How long after BIRD's start every peer must be Established for readiness (later one is
#: enough), as Calico's readiness check does.
DEFAULT_SETTLE_SECONDS = 30.0
#: ``show protocols all`` of a session whose peer went away without a notification (its
#: BIRD restarts): BIRD keeps the peer's routes (as stale) until it is back or its restart
#: time is over.
NEIGHBOR_RESTARTING = "Neighbor graceful restart active"
RESTARTING_KEY = "Neighbor graceful restart"


class BirdError(Exception):
    """Base of this module's errors."""


class BirdUnavailable(BirdError):
    """Nothing answers on the control socket (BIRD not running, or not yet)."""


class BirdCommandError(BirdError):
    """BIRD answered a command with an error code (8xxx run-time, 9xxx parse)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"BIRD error {code:04d}: {message}")
        self.code = code
        self.message = message


@dataclasses.dataclass(frozen=True)
class ReplyLine:
    code: int
    text: str


def parse_time(text: str) -> dt.datetime | None:
    """A BIRD time in the rendered format as an aware UTC datetime; None if it is not one."""
    try:
        return dt.datetime.strptime(text, _TIME_FORMAT).astimezone(dt.UTC)
    except ValueError:
        return None


def iso_utc(when: dt.datetime) -> str:
    """``2024-05-01T12:00:03Z``: ISO 8601 in UTC, whole seconds (truncated)."""
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(frozen=True)
class ProtocolStatus:
    """One protocol of ``show protocols all``.

    ``kind`` is BIRD's protocol type (``BGP``, ``Kernel``, ``Static``, ``Device``,
    ``Direct``), ``state`` BIRD's protocol state (``up``, ``start``, ``stop``, ``down``,
    ``flush``), ``info`` the summary column (for BGP the session state and last error).
    ``details`` holds the protocol's own ``key: value`` lines (``BGP state``, ``Neighbor
    address``, ``Neighbor AS``, ``Description``, ``Last error``, ...), ``channels`` the same
    per channel (``ipv4``: ``State``, ``Routes``, ...).
    """

    name: str
    kind: str
    table: str
    state: str
    since: dt.datetime | None
    info: str
    details: Mapping[str, str] = dataclasses.field(default_factory=dict)
    channels: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)

    @property
    def bgp_state(self) -> str:
        """BIRD's name of the BGP session state (``Established`` when up); "" if not BGP."""
        if self.kind != "BGP":
            return ""
        return self.details.get("BGP state") or (self.info.split() or [""])[0]


@dataclasses.dataclass(frozen=True)
class PeerStatus:
    """A BGP session of tabby's, as ``tabbyctl node status`` shows it."""

    name: str  # the BIRD protocol
    address: IPAddress
    type: PeerType
    state: str  # BIRD's BGP state: Established, Active, Connect, OpenSent, Idle, Passive, ...
    since: str  # ISO 8601 UTC of the last state change; "" if BIRD gave none
    info: str
    protocol_state: str  # BIRD's protocol state: up, start, ...
    neighbor_as: int | None = None
    description: str = ""
    last_error: str = ""
    #: The peer is restarting (graceful restart): its routes are kept meanwhile.
    restarting: bool = False

    @property
    def established(self) -> bool:
        return self.state == ESTABLISHED

    def as_dict(self) -> dict[str, object]:
        return {
            "address": str(self.address),
            "type": self.type.value,
            "state": self.state,
            "since": self.since,
            "info": self.info,
            "protocol": self.name,
            "peer_as": self.neighbor_as,
            "description": self.description,
            "last_error": self.last_error,
        }


@dataclasses.dataclass(frozen=True)
class BirdStatus:
    """``show status``: version, router id, clock, start and reconfiguration times."""

    version: str
    router_id: str
    server_time: dt.datetime | None
    boot_time: dt.datetime | None
    reconfigured_at: dt.datetime | None
    graceful_restart_recovery: bool
    message: str  # "Daemon is up and running", "Reconfiguration in progress", ...

    @property
    def uptime_seconds(self) -> float | None:
        if self.server_time is None or self.boot_time is None:
            return None
        return (self.server_time - self.boot_time).total_seconds()


class SinceMemo:
    """Keeps each session's reported "since" fixed while its state does not change.

    BIRD's value for an unchanged session moves by microseconds between queries (and by
    clock slews over days); truncating to seconds alone would make it flip near a second
    boundary. A new value within ``tolerance`` seconds of the last one, in the same state,
    is the same event: the first string reported for it stays.
    """

    def __init__(self, tolerance: float = 0.25) -> None:
        self._tolerance = tolerance
        self._seen: dict[str, tuple[str, dt.datetime, str]] = {}

    def stable(self, key: str, state: str, since: dt.datetime) -> str:
        prev = self._seen.get(key)
        if (
            prev is not None
            and prev[0] == state
            and abs((since - prev[1]).total_seconds()) < self._tolerance
        ):
            text = prev[2]
        else:
            text = iso_utc(since)
        self._seen[key] = (state, since, text)
        return text

    def forget_others(self, keep: Iterable[str]) -> None:
        keep = set(keep)
        for key in [k for k in self._seen if k not in keep]:
            del self._seen[key]


def parse_reply(lines: Iterable[str]) -> list[ReplyLine]:
    """Give every raw reply line its code (continuations inherit it); ``+`` lines dropped."""
    out: list[ReplyLine] = []
    code = 0
    for raw in lines:
        line = raw.rstrip("\n")
        if line.startswith("+"):
            continue
        if line.startswith(" "):
            out.append(ReplyLine(code, line[1:]))
            continue
        if len(line) >= 5 and line[:4].isdigit() and line[4] in "- ":
            code = int(line[:4])
            out.append(ReplyLine(code, line[5:]))
            continue
        raise BirdError(f"unexpected line from BIRD: {line!r}")
    return out


def _split_key(text: str) -> tuple[str, str] | None:
    key, sep, value = text.strip().partition(":")
    if not sep or not key:
        return None
    return key.strip(), value.strip()


def parse_protocols(reply: Sequence[ReplyLine]) -> list[ProtocolStatus]:
    """Protocols from the reply to ``show protocols [all]``."""
    out: list[ProtocolStatus] = []
    details: dict[str, str] = {}
    channel: dict[str, str] | None = None
    for line in reply:
        if line.code == 1002:
            fields = line.text.split(None, 5)
            if len(fields) < 5:
                raise BirdError(f"unexpected protocol line from BIRD: {line.text!r}")
            details, channel = {}, None
            out.append(
                ProtocolStatus(
                    name=fields[0],
                    kind=fields[1],
                    table=fields[2],
                    state=fields[3],
                    since=parse_time(fields[4]),
                    info=fields[5].strip() if len(fields) > 5 else "",
                    details=details,
                    channels={},
                )
            )
        elif line.code == 1006 and out:
            text = line.text.strip()
            if text.startswith("Channel "):
                channels = out[-1].channels
                assert isinstance(channels, dict)
                channel = channels.setdefault(text.split(None, 1)[1], {})
                continue
            if text == NEIGHBOR_RESTARTING and channel is None:
                details.setdefault(RESTARTING_KEY, "active")
                continue
            kv = _split_key(text)
            if kv is not None:
                (channel if channel is not None else details).setdefault(*kv)
    return out


def peer_statuses(
    protocols: Iterable[ProtocolStatus], memo: SinceMemo | None = None
) -> list[PeerStatus]:
    """tabby's BGP sessions (protocols named by :func:`render.protocol_name`), sorted by
    type and address; ``memo`` keeps "since" stable across calls."""
    out: list[PeerStatus] = []
    for proto in protocols:
        if proto.kind != "BGP":
            continue
        parsed = parse_protocol_name(proto.name)
        if parsed is None:
            continue
        kind, address = parsed
        state = proto.bgp_state
        since = ""
        if proto.since is not None:
            since = memo.stable(proto.name, state, proto.since) if memo else iso_utc(proto.since)
        neighbor_as = proto.details.get("Neighbor AS", "")
        out.append(
            PeerStatus(
                name=proto.name,
                address=address,
                type=kind,
                state=state,
                since=since,
                info=proto.info,
                protocol_state=proto.state,
                neighbor_as=int(neighbor_as) if neighbor_as.isdigit() else None,
                description=proto.details.get("Description", ""),
                last_error=proto.details.get("Last error", ""),
                restarting=proto.details.get(RESTARTING_KEY) == "active",
            )
        )
    if memo is not None:
        memo.forget_others(p.name for p in out)
    order = list(PeerType)
    out.sort(key=lambda p: (order.index(p.type), p.address.version, p.address))
    return out


def parse_status(reply: Sequence[ReplyLine]) -> BirdStatus:
    """``show status``."""
    values = {"version": "", "router_id": "", "server": "", "boot": "", "reconf": ""}
    prefixes = {
        "Router ID is ": "router_id",
        "Current server time is ": "server",
        "Last reboot on ": "boot",
        "Last reconfiguration on ": "reconf",
    }
    graceful = False
    message = ""
    for line in reply:
        if line.code == 1000 and line.text.startswith("BIRD "):
            values["version"] = line.text[5:].strip()
        elif line.code == 1011:
            for prefix, key in prefixes.items():
                if line.text.startswith(prefix):
                    values[key] = line.text[len(prefix) :].strip()
        elif line.code == 24 and "recovery in progress" in line.text:
            graceful = True
        elif line.code == 13:
            message = line.text
    return BirdStatus(
        version=values["version"],
        router_id=values["router_id"],
        server_time=parse_time(values["server"]),
        boot_time=parse_time(values["boot"]),
        reconfigured_at=parse_time(values["reconf"]),
        graceful_restart_recovery=graceful,
        message=message,
    )


def readiness(
    status: BirdStatus | None,
    peers: Sequence[PeerStatus],
    *,
    settle_seconds: float = DEFAULT_SETTLE_SECONDS,
) -> list[str]:
    """Why BGP is not ready (empty: ready), counted as Calico counts it: BIRD must answer
    and not be in graceful-restart recovery; no peers is fine; for ``settle_seconds`` after
    BIRD started every peer must be Established, later at least one. A peer that is
    restarting (graceful restart: its routes are kept) is not down: one node's upgrade must
    not make the others unready (a DaemonSet replaces an unready pod at once)."""
    if status is None:
        return ["BIRD is not running"]
    reasons = []
    if status.graceful_restart_recovery:
        reasons.append("BIRD: graceful restart recovery in progress")
    if not peers:
        return reasons
    down = [p for p in peers if not p.established and not p.restarting]
    uptime = status.uptime_seconds
    if uptime is None or uptime < settle_seconds:
        reasons += [
            f"BGP not established with {p.address} ({p.type.value}: {p.state})" for p in down
        ]
    elif len(down) == len(peers):
        reasons.append(f"BGP not established with any of {len(peers)} peers")
    return reasons


class BirdControl:
    """One connection to BIRD's control socket (a context manager)::

    with BirdControl("/run/tabby/bird.ctl") as bird:
        peers = peer_statuses(bird.show_protocols())
    """

    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self.path = path
        self.timeout = timeout
        self.version = ""
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self._pos = 0

    def open(self) -> BirdControl:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise BirdUnavailable(
                f"BIRD control socket {self.path}: {exc.strerror or exc}"
            ) from exc
        self._sock = sock
        try:
            hello = self._read_reply()
        except (OSError, BirdError) as exc:
            self.close()
            raise BirdUnavailable(f"BIRD control socket {self.path}: no greeting ({exc})") from exc
        if not hello or hello[-1].code != 1:
            self.close()
            raise BirdUnavailable(f"BIRD control socket {self.path}: unexpected greeting")
        words = hello[-1].text.split()
        self.version = words[1] if len(words) > 1 and words[0] == "BIRD" else ""
        return self

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buf = bytearray()
        self._pos = 0

    def __enter__(self) -> BirdControl:
        return self.open() if self._sock is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def server_pid(self) -> int:
        """The PID of the BIRD that listens on the socket (SO_PEERCRED; BIRD runs with
        ``-f``, so the listener is the daemon itself)."""
        sock = self._connected()
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        pid, _uid, _gid = _PEERCRED.unpack(raw)
        return int(pid)

    def _connected(self) -> socket.socket:
        if self._sock is None:
            self.open()
        assert self._sock is not None
        return self._sock

    def _readline(self) -> str:
        """One line of the reply (a position in a buffer: a long reply is not re-copied
        per line)."""
        sock = self._connected()
        while True:
            end = self._buf.find(b"\n", self._pos)
            if end >= 0:
                line = self._buf[self._pos : end].decode("utf-8", "replace")
                self._pos = end + 1
                return line
            del self._buf[: self._pos]
            self._pos = 0
            if len(self._buf) > _MAX_LINE:
                raise BirdError("BIRD sent an over-long line")
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise BirdUnavailable("BIRD closed the control connection")
            self._buf += chunk

    def _read_reply(self) -> list[ReplyLine]:
        raw: list[str] = []
        while True:
            line = self._readline()
            raw.append(line)
            if len(line) >= 5 and line[:4].isdigit() and line[4] == " ":
                return parse_reply(raw)

    def command(self, cmd: str) -> list[ReplyLine]:
        """Send one command line; its reply lines. Raises :class:`BirdCommandError` when the
        reply ends with an error code."""
        if "\n" in cmd or "\r" in cmd:
            raise ValueError("a BIRD command is one line")
        sock = self._connected()
        try:
            sock.sendall(cmd.encode() + b"\n")
            reply = self._read_reply()
        except OSError as exc:
            self.close()
            raise BirdUnavailable(f"BIRD control socket {self.path}: {exc}") from exc
        last = reply[-1]
        if last.code >= 8000:
            raise BirdCommandError(last.code, last.text)
        return reply

    def show_protocols(self) -> list[ProtocolStatus]:
        return parse_protocols(self.command("show protocols all"))

    def show_status(self) -> BirdStatus:
        return parse_status(self.command("show status"))

    def configure(self, path: str | None = None) -> str:
        """Reload the configuration (BIRD's default file, or ``path``); BIRD's answer.
        Protocols whose options did not change keep running: no session reset."""
        cmd = "configure"
        if path is not None:
            if any(c in path for c in '"\n\r'):
                raise ValueError(f"unusable configuration path {path!r}")
            cmd += f' "{path}"'
        reply = self.command(cmd)
        last = reply[-1]
        # 3 Reconfigured, 4 in progress, 5 queued behind a running one, 17 replaced a queued one.
        if last.code not in (3, 4, 5, 17):
            raise BirdCommandError(last.code, last.text)
        return last.text

    def graceful_restart(self) -> str:
        """Shut BIRD down for a graceful restart (BIRD's ``graceful restart`` command): it
        closes its BGP sessions without a notification, so peers that negotiated graceful
        restart keep this node's routes (as stale, for their restart time) until a new BIRD
        has sent them again, and its kernel protocols leave their routes in place. BIRD
        exits; its answer is returned."""
        reply = self.command("graceful restart")
        last = reply[-1]
        if last.code != 25:  # 0025 Graceful restart requested
            raise BirdCommandError(last.code, last.text)
        return last.text


def read_peers(path: str, memo: SinceMemo | None = None, timeout: float = 5.0) -> list[PeerStatus]:
    """tabby's BGP sessions from the BIRD listening on ``path``."""
    with BirdControl(path, timeout) as bird:
        return peer_statuses(bird.show_protocols(), memo)


def read_status(path: str, timeout: float = 5.0) -> BirdStatus:
    with BirdControl(path, timeout) as bird:
        return bird.show_status()
