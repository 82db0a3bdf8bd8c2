"""Logging: a shared, size-rotated file; never stdout (docs/configuration.md "`tabby` fields",
``log_file_path``; cni_protocol/CONFORMANCE.md GEN-5)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from cni_protocol import log
from tests import REPO_ROOT


def test_rotation_keeps_whole_records_and_a_bounded_number_of_files(tmp_path: Path) -> None:
    path = tmp_path / "cni.log"
    handler = log.SharedRotatingFileHandler(str(path), max_bytes=2000, backups=3)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("tabby.test-rotation")
    logger.propagate = False
    logger.addHandler(handler)
    try:
        for n in range(400):
            logger.warning("record %04d %s", n, "x" * 40)
    finally:
        logger.removeHandler(handler)
    files = sorted(os.listdir(tmp_path))
    assert files == ["cni.log", "cni.log.1", "cni.log.2", "cni.log.3"]
    for name in files:
        text = (tmp_path / name).read_text()
        assert os.path.getsize(tmp_path / name) <= 2000 + 100
        assert all(line.startswith("record ") for line in text.splitlines())
    assert "record 0399" in path.read_text()


def test_log_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "cni.log"
    log.setup("info", str(path), stderr=False)
    try:
        logging.getLogger("tabby.test").warning("hello")
    finally:
        log.setup("info", None, stderr=False)
    assert path.read_text().strip().endswith("hello")
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_a_resident_process_without_a_log_file_logs_to_stderr_at_its_level(
    tmp_path: Path,
) -> None:
    """tabby-node in a container (``--log-file ''``): stderr is its log, info included;
    with a file, stderr keeps only warnings and errors."""
    import subprocess
    import sys

    script = (
        "import logging, sys\n"
        "from cni_protocol import log\n"
        "log.setup_resident('info', sys.argv[1] or None)\n"
        "logging.getLogger('tabby.node').info('an info line')\n"
        "logging.getLogger('tabby.node').debug('a debug line')\n"
        "logging.getLogger('tabby.node').warning('a warning line')\n"
    )
    root = REPO_ROOT

    def stderr_of(path: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-c", script, path],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        )
        return proc.stderr

    alone = stderr_of("")
    assert "an info line" in alone
    assert "a warning line" in alone
    assert "a debug line" not in alone
    with_file = stderr_of(str(tmp_path / "node.log"))
    assert "an info line" not in with_file
    assert "a warning line" in with_file
    assert "an info line" in (tmp_path / "node.log").read_text()
