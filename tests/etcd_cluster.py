"""Real etcd clusters for tests and benchmarks: 1 or 3 members on 127.0.0.1.

Every member gets random free ports and a data dir inside one private temp dir; ``stop()``
(also on failure, and from ``with``) kills each member by its PID and removes the temp dir.
Other engineers run etcd on the same machine at the same time: nothing here uses a fixed
port or a shared path, and nothing is ever stopped by name.

    with EtcdCluster(3) as cluster:
        cluster.endpoints            # ["http://127.0.0.1:P0", ...]
        cluster.kill(cluster.leader())   # SIGKILL
        cluster.start_member(i)       # same data dir, same ports
        cluster.wait_healthy()

TLS (``tls=True``): a CA, a server certificate for 127.0.0.1 and a client certificate are made
with the ``openssl`` CLI in the temp dir (``cluster.tls``); client URLs are https and demand a
client certificate signed by that CA. Peer traffic stays plain http on loopback.

Standard library only, so bench/ and every test tier can import it (``tests`` is a package).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

ETCD = "etcd"


class EtcdMissing(RuntimeError):
    """The ``etcd`` binary is not on PATH (Debian: apt-get install etcd-server)."""


def etcd_binary() -> str | None:
    return shutil.which(ETCD)


@dataclass(frozen=True)
class TlsFiles:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    dir: str

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


def make_tls(directory: str | Path) -> TlsFiles:
    """A throw-away CA, a server cert (127.0.0.1, localhost) and a client cert, via openssl."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ext = d / "server.ext"
    ext.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
    )
    cext = d / "client.ext"
    cext.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=clientAuth\n"
    )
    run("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "ca.key")
    run(
        "req", "-x509", "-new", "-key", "ca.key", "-sha256", "-days", "2",
        "-subj", "/CN=tabby-test-ca", "-out", "ca.crt",
    )  # fmt: skip
    for name, extfile in (("server", ext), ("client", cext)):
        run("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", f"{name}.key")
        run("req", "-new", "-key", f"{name}.key", "-subj", f"/CN={name}", "-out", f"{name}.csr")
        run(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-sha256", "-extfile", str(extfile),
            "-out", f"{name}.crt",
        )  # fmt: skip
    for f in d.iterdir():
        if f.suffix == ".key":
            f.chmod(0o600)
    return TlsFiles(
        ca=str(d / "ca.crt"),
        server_cert=str(d / "server.crt"),
        server_key=str(d / "server.key"),
        client_cert=str(d / "client.crt"),
        client_key=str(d / "client.key"),
        dir=str(d),
    )


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: str
    log_path: str
    scheme: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class EtcdCluster:
    """``size`` etcd members on 127.0.0.1; see the module docstring."""

    def __init__(
        self,
        size: int = 1,
        *,
        tls: bool = False,
        heartbeat_ms: int = 50,
        election_ms: int = 500,
        start_timeout: float = 30.0,
        extra_args: Sequence[str] = (),
    ) -> None:
        binary = etcd_binary()
        if binary is None:
            raise EtcdMissing("etcd not found on PATH (Debian: apt-get install etcd-server)")
        self.binary = binary
        self.size = size
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.start_timeout = start_timeout
        self.extra_args = list(extra_args)  # more etcd flags for every member
        self.base = tempfile.mkdtemp(prefix=f"tabby-etcd-{os.getpid()}-")
        self.tls: TlsFiles | None = None
        self.members: list[Member] = []
        self.token = f"tabby-{uuid.uuid4().hex[:12]}"
        try:
            if tls:
                self.tls = make_tls(os.path.join(self.base, "tls"))
            self._start_all()
        except BaseException:
            self.stop()
            raise

    # -- life cycle ---------------------------------------------------------------------

    def _start_all(self) -> None:
        for attempt in range(3):  # a port taken between probe and bind: new ports, retry
            ports = free_ports(2 * self.size)
            scheme = "https" if self.tls else "http"
            self.members = [
                Member(
                    name=f"m{i}",
                    client_port=ports[2 * i],
                    peer_port=ports[2 * i + 1],
                    data_dir=os.path.join(self.base, f"m{i}-{attempt}"),
                    log_path=os.path.join(self.base, f"m{i}-{attempt}.log"),
                    scheme=scheme,
                )
                for i in range(self.size)
            ]
            for i in range(self.size):
                self.start_member(i, new=True)
            try:
                self.wait_healthy(self.start_timeout)
                return
            except RuntimeError:
                if attempt == 2 or not self._port_clash():
                    raise
                self._kill_all()

    def _port_clash(self) -> bool:
        for m in self.members:
            try:
                if "address already in use" in Path(m.log_path).read_text():
                    return True
            except OSError:
                pass
        return False

    def start_member(self, i: int, *, new: bool = False) -> None:
        """Start member i (again: same data dir and ports; it rejoins the cluster)."""
        m = self.members[i]
        if m.running:
            return
        initial = ",".join(f"{x.name}={x.peer_url}" for x in self.members)
        args = [
            self.binary,
            "--name", m.name,
            "--data-dir", m.data_dir,
            "--listen-client-urls", m.client_url,
            "--advertise-client-urls", m.client_url,
            "--listen-peer-urls", m.peer_url,
            "--initial-advertise-peer-urls", m.peer_url,
            "--initial-cluster", initial,
            "--initial-cluster-token", self.token,
            "--initial-cluster-state", "new",
            "--heartbeat-interval", str(self.heartbeat_ms),
            "--election-timeout", str(self.election_ms),
            "--logger", "zap",
            "--log-outputs", "stderr",
            *self.extra_args,
        ]  # fmt: skip
        if self.tls:
            args += [
                "--cert-file", self.tls.server_cert,
                "--key-file", self.tls.server_key,
                "--trusted-ca-file", self.tls.ca,
                "--client-cert-auth",
            ]  # fmt: skip
        log = open(m.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            m.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        finally:
            log.close()

    def kill(self, i: int) -> None:
        """SIGKILL member i (its data dir stays: ``start_member`` brings it back)."""
        self._signal(i, signal.SIGKILL)

    def stop_member(self, i: int) -> None:
        """SIGTERM member i and wait for it (SIGKILL after 10 s)."""
        self._signal(i, signal.SIGTERM)

    def _signal(self, i: int, sig: int) -> None:
        m = self.members[i]
        proc = m.proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
        m.proc = None

    def _kill_all(self) -> None:
        for i in range(len(self.members)):
            try:
                self.kill(i)
            except Exception:
                pass

    def stop(self) -> None:
        """Kill every member by PID and remove the temp dir (data, logs, TLS files)."""
        self._kill_all()
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- talking to members -------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    def request(self, i: int, path: str, body: dict[str, Any], timeout: float = 5.0) -> Any:
        """POST ``body`` to member i's gRPC-JSON gateway; the decoded answer (raises on
        connection errors and on HTTP errors)."""
        m = self.members[i]
        conn: http.client.HTTPConnection
        if self.tls:
            conn = http.client.HTTPSConnection(
                "127.0.0.1", m.client_port, timeout=timeout, context=self.tls.client_context()
            )
        else:
            conn = http.client.HTTPConnection("127.0.0.1", m.client_port, timeout=timeout)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{m.name} {path}: HTTP {resp.status} {data[:200]!r}")
            return json.loads(data)
        finally:
            conn.close()

    def status(self, i: int, timeout: float = 2.0) -> dict[str, Any]:
        result: dict[str, Any] = self.request(i, "/v3/maintenance/status", {}, timeout)
        return result

    def healthy(self, i: int) -> bool:
        """Member i runs and serves a linearizable read (so the cluster has a leader)."""
        if not self.members[i].running:
            return False
        try:
            self.request(i, "/v3/kv/range", {"key": _b64("health")}, timeout=2.0)
        except (OSError, RuntimeError, ValueError):
            return False
        return True

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Until every running member answers a linearizable read (RuntimeError if not)."""
        deadline = time.monotonic() + timeout
        pending = [i for i, m in enumerate(self.members) if m.running]
        while pending:
            pending = [i for i in pending if not self.healthy(i)]
            dead = [self.members[i].name for i in pending if not self.members[i].running]
            if dead:
                raise RuntimeError(f"etcd member(s) {dead} exited: {self.logs_tail()}")
            if not pending:
                return
            if time.monotonic() > deadline:
                names = [self.members[i].name for i in pending]
                raise RuntimeError(f"etcd member(s) {names} not healthy: {self.logs_tail()}")
            time.sleep(0.05)

    def leader(self, timeout: float = 15.0) -> int:
        """Index of the current leader (waits for an election if there is none)."""
        deadline = time.monotonic() + timeout
        while True:
            for i, m in enumerate(self.members):
                if not m.running:
                    continue
                try:
                    st = self.status(i)
                except (OSError, RuntimeError, ValueError):
                    continue
                leader = st.get("leader")
                if leader and leader == st.get("header", {}).get("member_id"):
                    return i
            if time.monotonic() > deadline:
                raise RuntimeError("no etcd leader")
            time.sleep(0.05)

    def put(self, key: str, value: str, i: int | None = None) -> int:
        """A plain put (test set-up); the new revision."""
        idx = i if i is not None else self._any_running()
        body = {"key": _b64(key), "value": _b64(value)}
        return int(self.request(idx, "/v3/kv/put", body)["header"]["revision"])

    def revision(self) -> int:
        answer = self.request(self._any_running(), "/v3/kv/range", {"key": _b64("\0")})
        return int(answer["header"]["revision"])

    def compact(self, revision: int | None = None) -> int:
        """Compact the history up to ``revision`` (default: the current one)."""
        rev = revision if revision is not None else self.revision()
        self.request(self._any_running(), "/v3/kv/compaction", {"revision": rev, "physical": True})
        return rev

    def _any_running(self) -> int:
        for i, m in enumerate(self.members):
            if m.running:
                return i
        raise RuntimeError("no etcd member is running")

    def logs_tail(self, lines: int = 5) -> str:
        out = []
        for m in self.members:
            try:
                text = Path(m.log_path).read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                text = []
            out.append(f"[{m.name}] " + " | ".join(t[:300] for t in text))
        return "\n".join(out)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()
