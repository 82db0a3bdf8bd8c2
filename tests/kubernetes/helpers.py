"""Small helpers of the Kubernetes tier's tests."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from lab.kubernetes.cluster import KubeLab


def tabby_get(
    kube: KubeLab, kind: str, name: str | None = None, namespace: str | None = None
) -> Any:
    """``tabbyctl get`` as JSON (None when the resource does not exist)."""
    args = ["get", kind, *([name] if name else []), "-o", "json"]
    if namespace:
        args += ["-n", namespace]
    proc = kube.tabbyctl(*args)
    if proc.returncode != 0:
        if "not found" in proc.stderr:
            return None
        raise AssertionError(f"tabbyctl {' '.join(args)}: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def eventually(what: str, check: Callable[[], object], timeout: float = 10.0) -> float:
    """Seconds until ``check()`` is true; AssertionError naming ``what`` after ``timeout``."""
    start = time.monotonic()
    last: object = None
    while True:
        try:
            last = check()
        except AssertionError as e:
            last = e
        if last is True:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout} s (last: {last})")
        time.sleep(0.1)
