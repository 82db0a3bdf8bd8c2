"""kube_bench's burst case times each ADD by the plugin's "added" line in the CNI log: the
line as cni_protocol.log writes it today must parse (a format change once made the case
report no ADD at all)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from bench.kubernetes.kube_bench import added_times
from tests import REPO_ROOT

WRITE = """
import logging, sys
from cni_protocol import log
log.configure_for_call("info", sys.argv[1], "ADD", "c" * 64, "eth0")
plugin = logging.getLogger("tabby.plugin")
plugin.info("added %s on %s (host veth %s)", "10.0.0.1/32", "/x", "calic")
plugin.info("something else")
"""


def test_the_added_line_the_plugin_logs_is_the_one_the_bench_reads(tmp_path: Path) -> None:
    path = tmp_path / "cni.log"
    before = time.time()
    subprocess.run([sys.executable, "-c", WRITE, str(path)], check=True, cwd=REPO_ROOT)
    text = path.read_text()
    (at,) = added_times(text, before - 1)
    assert before - 1 <= at <= time.time() + 1
    assert added_times(text, time.time() + 5) == []
