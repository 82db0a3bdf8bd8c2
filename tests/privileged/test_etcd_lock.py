"""The etcd store's node lock (``datastore.etcd.store``): its file is named by the endpoints,
the prefix and the network namespace, so two "nodes" of one machine (namespaces, as the lab
makes them) never share it (needs root: ``unshare --net``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from datastore.etcd.store import EtcdStore

pytestmark = pytest.mark.privileged

ROOT = Path(__file__).resolve().parents[2]


def test_lock_file_differs_per_network_namespace(tmp_path: Path) -> None:
    code = (
        "from datastore.etcd.store import EtcdStore\n"
        f"print(EtcdStore(['http://127.0.0.1:2379'], lock_dir={str(tmp_path)!r}).lock_path)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    here = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    there = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert here.strip() == EtcdStore(["http://127.0.0.1:2379"], lock_dir=str(tmp_path)).lock_path
    assert here != there
