"""kill -9 at random instants against the file store: the store stays consistent.

Two worker processes (two nodes sharing one store, so blocks are claimed, filled, borrowed
and GC'd concurrently) run random ADD/DEL/GC loops; each round both are SIGKILLed at random
times. After every round: no broken invariant, and every acknowledged ADD is still held.
At the end, releasing every handle leaves the pools empty.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from datastore.file import FileStore
from ipam.core import Ipam, check_consistency

ROUNDS = 60
NETWORK = "crashnet"

WORKER = r"""
import random, sys
from ipam.core import AssignRequest, Ipam, DatastoreError, PoolSpec, handle_id
from datastore.file import FileStore

data_dir, node, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rnd = random.Random(seed)


def say(*words):  # one write per line, even with PYTHONUNBUFFERED
    sys.stdout.write(" ".join(map(str, words)) + "\n")
    sys.stdout.flush()


store = FileStore(data_dir, lock_timeout=20)
ipam = Ipam(store, node)
ipam.ensure_pools([PoolSpec("10.30.0.0/24", 28), PoolSpec("fd30::/120", 124)])
mine = [k for k in store.list_keys("handle") if k.startswith(f"crashnet:{node}-")]
say("up")
n = 0
while True:
    n += 1
    r = rnd.random()
    if r < 0.55 or not mine:
        hid = handle_id("crashnet", f"{node}-{seed}-{n}", "eth0")
        specific = []
        if rnd.random() < 0.1:
            specific = [f"10.30.0.{rnd.randrange(256)}"]
        say("a", hid)
        try:
            got = ipam.assign(AssignRequest(hid, {"pod_name": hid}, True, rnd.random() < 0.5,
                                            ["10.30.0.0/24"], ["fd30::/120"], specific))
        except DatastoreError as e:
            say("x", hid, type(e).__name__)
            continue
        say("A", hid, *sorted(str(a.ip) for a in got))
        mine.append(hid)
    elif r < 0.97:
        hid = mine.pop(rnd.randrange(len(mine)))
        say("r", hid)
        ipam.release_handle(hid)
        say("R", hid)
    else:
        keep = set(rnd.sample(mine, len(mine) // 2))
        say("g", *sorted(keep))
        report = ipam.gc("crashnet", {(h.split(":")[1], "eth0") for h in keep}, grace_seconds=0)
        mine = sorted(keep)
        say("G", *sorted(report.released))
"""


@pytest.mark.slow
def test_sigkill_at_random_instants(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    data_dir = str(tmp_path / "ipam")
    store = FileStore(data_dir, lock_timeout=10)
    rnd = random.Random(20240611)
    acked: dict[str, list[str]] = {}  # acknowledged ADDs without a DEL or GC started
    killed_busy = 0
    mid_op = 0  # kills that hit an operation between its start and its acknowledgement
    ops = 0
    for rnd_no in range(ROUNDS):
        errs = {node: tmp_path / f"{node}.err" for node in ("node-a", "node-b")}
        procs = {}
        for i, node in enumerate(errs):
            with errs[node].open("w") as err_file:
                procs[node] = subprocess.Popen(
                    [sys.executable, "-c", WORKER, data_dir, node, str(rnd_no * 2 + i)],
                    stdout=subprocess.PIPE,
                    stderr=err_file,
                    env=subprocess_env,
                    text=True,
                )
        for node, proc in procs.items():
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line == "up\n", errs[node].read_text()
        time.sleep(rnd.uniform(0.0, 0.12))
        order = list(procs.values())
        rnd.shuffle(order)
        for proc in order:
            proc.send_signal(signal.SIGKILL)
            time.sleep(rnd.uniform(0.0, 0.02))
        for node, proc in procs.items():
            assert proc.stdout is not None
            out = proc.stdout.read()  # the rest, after what readline() buffered
            proc.stdout.close()
            proc.wait()
            if proc.returncode == -signal.SIGKILL:
                killed_busy += 1
            else:
                pytest.fail(f"worker ended by itself: {errs[node].read_text()[-2000:]}")
            lines = out.splitlines()
            if out and not out.endswith("\n"):
                lines.pop()  # cut by the kill: that step had not started (or not been acked)
            mid_op += bool(lines) and lines[-1][:1] in "arg"
            for line in lines:
                verb, *rest = line.split()
                ops += verb in "ARG"
                if verb == "A":
                    acked[rest[0]] = rest[1:]
                elif verb == "r":
                    acked.pop(rest[0], None)
                elif verb == "g":  # this worker's GC: its node's other handles may go
                    keep = set(rest)
                    for h in list(acked):
                        if h not in keep and h.startswith(f"{NETWORK}:{node}-"):
                            acked.pop(h)
        problems = check_consistency(store)
        assert [p for p in problems if p.severity == "error"] == [], f"round {rnd_no}"
        reader = Ipam(store, "")
        for h, ips in acked.items():
            held = sorted(str(a.ip) for a in reader.get_handle(h))
            assert held == ips, f"round {rnd_no}: acknowledged {h} lost its addresses"
    assert killed_busy == 2 * ROUNDS
    assert ops > ROUNDS  # the workers did real work between kills
    assert mid_op > ROUNDS // 2, mid_op
    print(f"{ops} operations acknowledged, {mid_op} kills in the middle of one")
    # Cleanup as DEL would do it, each node releasing its handles through its index:
    # pools empty, store clean.
    for node in ("node-a", "node-b"):
        mine = Ipam(store, node)
        for h in sorted({o.handle_id for o in mine.allocations() if f":{node}-" in o.handle_id}):
            mine.release_handle(h)
    assert sum(p.in_use for p in Ipam(store, "").pool_usage()) == 0
    for node in ("node-a", "node-b"):
        Ipam(store, node).gc(NETWORK, set(), grace_seconds=0)  # repairs indexes, adopts orphans
    assert check_consistency(store) == []
