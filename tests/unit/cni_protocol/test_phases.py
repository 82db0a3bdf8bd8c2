"""Where a served call's time goes (``cni_protocol.phases``): what the verbs add is kept
per thread and only while the server records; the server's own share is the rest."""

from __future__ import annotations

import threading

import pytest

from cni_protocol import phases


def test_nothing_is_kept_when_no_call_is_recorded() -> None:
    phases.add("ipam", 1.0)  # a standalone binary: nobody called begin()
    with phases.timed("netlink"):
        pass
    assert phases.end(0.5) == {"server": 0.5}


def test_the_server_gets_the_rest_of_the_phases_on_the_path() -> None:
    phases.begin()
    phases.add("ipam", 0.004)
    phases.add("ipam", 0.001)
    phases.add("netlink", 0.009)  # beside ipam: only its wait is on the path
    phases.add("netlink_wait", 0.003)
    phases.add("endpoint", 0.007)  # beside netlink: only its wait is on the path
    phases.add("endpoint_wait", 0.002)
    got = phases.end(0.015)
    assert got["ipam"] == pytest.approx(0.005)
    assert got["netlink"] == pytest.approx(0.009)
    assert got["endpoint"] == pytest.approx(0.007)
    assert got["server"] == pytest.approx(0.015 - 0.005 - 0.003 - 0.002)
    assert phases.end(0.001) == {"server": 0.001}  # end() stopped the recording


def test_on_path_counts_the_phase_and_its_wait() -> None:
    phases.begin()
    phases.on_path("netlink", 0.003)
    with phases.timed("netlink", waited=True):
        pass
    got = phases.end(0.010)
    assert got["netlink"] == got["netlink_wait"] == pytest.approx(0.003, abs=0.001)
    assert got["server"] == pytest.approx(0.007, abs=0.001)


def test_timed_counts_a_block_that_raises_and_threads_are_apart() -> None:
    phases.begin()
    with pytest.raises(RuntimeError), phases.timed("netlink"):
        raise RuntimeError("kernel said no")
    thread = threading.Thread(target=phases.add, args=("ipam", 1.0))
    thread.start()
    thread.join()
    got = phases.end(10.0)
    assert "netlink" in got
    assert "ipam" not in got  # the other thread recorded nothing of this call
