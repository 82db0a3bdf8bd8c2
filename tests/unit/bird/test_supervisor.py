"""The BIRD supervisor's process logic against a fake ``bird`` (no root, no real BGP).

The fake is a small Python script with BIRD's command line: ``-p -c FILE`` rejects a file
containing ``INVALID`` the way BIRD does; ``-f -c CONF -s CTL -P PID [-R]`` writes the pid
file, greets on the control socket, answers ``configure`` and ``show status``, records every
launch and command, and on SIGTERM (or ``graceful restart``) removes its socket and pid
file as BIRD does. The real
daemon is covered by tests/privileged/test_bird.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bird import BirdConfigError, BirdStartError, BirdSupervisor

FAKE_BIRD = r"""#!{python}
import json, os, signal, socket, sys
args = sys.argv[1:]
opts = {{args[i]: args[i + 1] for i in range(len(args) - 1) if args[i] in ("-c", "-s", "-P")}}
record = os.environ["FAKE_BIRD_RECORD"]
def note(**kw):
    with open(record, "a") as f:
        f.write(json.dumps(kw) + "\n")
if "-p" in args:
    if "INVALID" in open(opts["-c"]).read():
        sys.stderr.write("bird: " + opts["-c"] + ":3:1 syntax error, unexpected INVALID\n")
        sys.exit(1)
    sys.exit(0)
if os.environ.get("FAKE_BIRD_FAIL"):
    sys.stderr.write("bird: cannot start: told to fail\n")
    sys.exit(1)
ctl, pidfile = opts["-s"], opts["-P"]
note(event="start", pid=os.getpid(), recover="-R" in args)
try:
    os.unlink(ctl)
except FileNotFoundError:
    pass
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(ctl)
srv.listen()
with open(pidfile, "w") as f:
    f.write(f"{{os.getpid()}}\n")
def term(*_):
    os.unlink(ctl)
    os.unlink(pidfile)
    os._exit(0)
signal.signal(signal.SIGTERM, term)
while True:
    conn, _ = srv.accept()
    with conn, conn.makefile("rwb") as f:
        f.write(b"0001 BIRD 2.0.12 ready.\n"); f.flush()
        for raw in f:
            cmd = raw.decode().strip()
            note(event="command", pid=os.getpid(), cmd=cmd)
            if cmd.startswith("configure"):
                f.write(b"0002-Reading configuration\n0003 Reconfigured\n")
            elif cmd == "show status":
                f.write(b"1000-BIRD 2.0.12\n0013 Daemon is up and running\n")
            elif cmd == "show protocols all":
                f.write(b"2002-Name Proto Table State Since Info\n0000 \n")
            elif cmd == "graceful restart" and not os.environ.get("FAKE_BIRD_NO_GRACEFUL"):
                f.write(b"0025 Graceful restart requested\n"); f.flush()
                note(event="graceful", pid=os.getpid())
                term()
            else:
                f.write(b"9001 syntax error\n")
            f.flush()
"""


class Fake:
    def __init__(self, tmp: Path) -> None:
        self.bird = tmp / "bird"
        self.bird.write_text(FAKE_BIRD.format(python=sys.executable))
        self.bird.chmod(0o755)
        self.record = tmp / "record.jsonl"
        self.run_dir = tmp / "run"

    def events(self, kind: str) -> list[dict[str, object]]:
        if not self.record.exists():
            return []
        rows = [json.loads(line) for line in self.record.read_text().splitlines()]
        return [r for r in rows if r["event"] == kind]

    def supervisor(self, **kw: float) -> BirdSupervisor:
        return BirdSupervisor(str(self.run_dir), bird=str(self.bird), **kw)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fake]:
    fake = Fake(tmp_path)
    monkeypatch.setenv("FAKE_BIRD_RECORD", str(fake.record))
    try:
        yield fake
    finally:
        for row in fake.events("start"):
            pid = row["pid"]
            assert isinstance(pid, int)
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def wait_for(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_start_apply_reject_stop(fake: Fake) -> None:
    sup = fake.supervisor()
    sup.start("router id 10.0.0.1;\n")
    try:
        assert not sup.adopted
        [started] = fake.events("start")
        assert started["pid"] == sup.pid
        assert started["recover"] is False  # nothing ran in this run directory before
        assert sup.running()
        assert sup.readiness() == []

        assert sup.apply("router id 10.0.0.1;\n") is False  # same text: no reload
        assert sup.apply("router id 10.0.0.2;\n") is True
        conf = fake.run_dir / "bird.conf"
        configures = [c["cmd"] for c in fake.events("command") if "configure" in str(c["cmd"])]
        assert configures == [f'configure "{conf}"']  # a new BIRD read the file at start
        assert conf.read_text() == "router id 10.0.0.2;\n"

        with pytest.raises(BirdConfigError, match="syntax error, unexpected INVALID"):
            sup.apply("INVALID\n")
        assert conf.read_text() == "router id 10.0.0.2;\n"
        assert not (fake.run_dir / "bird.conf.new").exists()
        assert len([c for c in fake.events("command") if "configure" in str(c["cmd"])]) == 1
    finally:
        sup.stop()
    assert not sup.running()
    assert not (fake.run_dir / "bird.pid").exists()
    assert not (fake.run_dir / "bird.ctl").exists()
    with pytest.raises(RuntimeError, match="not running"):
        sup.apply("router id 10.0.0.3;\n")


def test_a_rejected_text_starts_nothing(fake: Fake) -> None:
    sup = fake.supervisor()
    with pytest.raises(BirdConfigError):
        sup.start("INVALID\n")
    assert fake.events("start") == []
    assert not (fake.run_dir / "bird.conf").exists()


def test_dead_bird_is_restarted_with_backoff_and_graceful_restart(fake: Fake) -> None:
    sup = fake.supervisor(backoff_initial=0.05, backoff_max=0.2)
    sup.start("router id 10.0.0.1;\n")
    try:
        for n in (1, 2, 3):
            old = sup.pid
            assert old is not None
            os.kill(old, signal.SIGKILL)
            wait_for(lambda old=old: sup.pid not in (None, old) and sup.running())  # type: ignore[misc]
            assert sup.restarts == n
            assert "exited with status -9" in sup.last_exit
        starts = fake.events("start")
        assert [s["recover"] for s in starts] == [False, True, True, True]
        assert [s["pid"] for s in starts][-1] == sup.pid
    finally:
        sup.stop()


def test_a_bird_that_cannot_start_is_reported_with_its_words(
    fake: Fake, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_BIRD_FAIL", "1")
    sup = fake.supervisor()
    with pytest.raises(BirdStartError, match="told to fail"):
        sup.start("router id 10.0.0.1;\n")
    sup.stop()  # nothing to stop: no error


def test_detached_bird_is_adopted_and_reconfigured(fake: Fake) -> None:
    first = fake.supervisor()
    first.start("router id 10.0.0.1;\n")
    pid = first.pid
    first.detach()
    assert pid is not None
    assert fake.events("start")[-1]["pid"] == pid

    second = fake.supervisor()
    second.start("router id 10.0.0.9;\n")
    try:
        assert second.adopted
        assert second.pid == pid
        assert len(fake.events("start")) == 1  # no second BIRD
        configures = [c for c in fake.events("command") if "configure" in str(c["cmd"])]
        assert [c["pid"] for c in configures] == [pid]  # the adopted BIRD was reloaded
        # The adopted BIRD is supervised like our own: it is restarted if it dies.
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: second.pid not in (None, pid) and second.running())
        assert fake.events("start")[-1]["recover"] is True
    finally:
        second.stop()
        first.stop()  # already detached: a no-op


def test_stale_pidfile_and_socket_do_not_fool_adoption(fake: Fake) -> None:
    """A BIRD that died (SIGKILL leaves its socket and pid file): a new one starts, in
    graceful restart because the run directory shows a BIRD ran here."""
    first = fake.supervisor()
    first.start("router id 10.0.0.1;\n")
    pid = first.pid
    first.detach()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    assert (fake.run_dir / "bird.ctl").exists()

    second = fake.supervisor()
    second.start("router id 10.0.0.1;\n")
    try:
        assert not second.adopted
        assert second.pid != pid
        assert fake.events("start")[-1]["recover"] is True
    finally:
        second.stop()


def test_graceful_stop_asks_bird_for_a_graceful_restart(fake: Fake) -> None:
    """tabby-node's SIGTERM: BIRD is told ``graceful restart`` (it closes its sessions
    without a notification, peers keep the routes) and exits; the next BIRD in this run
    directory starts with -R."""
    sup = fake.supervisor()
    sup.start("router id 10.0.0.1;\n")
    pid = sup.pid
    sup.stop(graceful=True)
    assert [e["pid"] for e in fake.events("graceful")] == [pid]
    assert not sup.running()
    assert not (fake.run_dir / "bird.ctl").exists()
    successor = fake.supervisor()
    successor.start("router id 10.0.0.1;\n")
    try:
        assert not successor.adopted
        assert fake.events("start")[-1]["recover"] is True
    finally:
        successor.stop()


def test_graceful_stop_of_a_bird_that_refuses_is_a_sigkill(
    fake: Fake, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A BIRD that does not take the command is killed, not stopped with SIGTERM: SIGKILL
    also closes its sessions without a notification and leaves its routes."""
    monkeypatch.setenv("FAKE_BIRD_NO_GRACEFUL", "1")
    sup = fake.supervisor()
    sup.start("router id 10.0.0.1;\n")
    pid = sup.pid
    assert pid is not None
    sup.stop(graceful=True)
    assert fake.events("graceful") == []
    assert not sup.running()
    assert (fake.run_dir / "bird.ctl").exists()  # SIGKILLed: it could not clean up
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
