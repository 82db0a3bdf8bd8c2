"""Logging: a shared, size-rotated file; never stdout (README "`tabby` fields", ``log_file_path``;
cni_protocol/CONFORMANCE.md GEN-5)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from cni_protocol import log


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
