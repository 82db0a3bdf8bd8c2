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


# -- a new pod against an isolating policy (the same scene on both datastores) ------------------


def isolate_secret_pods(kube: KubeLab, ns: str) -> None:
    """A NetworkPolicy letting only ``role=client`` pods into ``app=secret`` ones, then a
    client pod on node-2 and a stranger on node-3, running."""
    kube.apply(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "secret", "namespace": ns},
            "spec": {
                "podSelector": {"matchLabels": {"app": "secret"}},
                "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}]}],
            },
        }
    )
    kube.apply(kube.sleeper_pod("client", ns, {"role": "client"}, nodeName="node-2"))
    kube.apply(kube.sleeper_pod("stranger", ns, {"role": "stranger"}, nodeName="node-3"))
    kube.wait_pods(ns, "", 2)


def secret_pod(kube: KubeLab, ns: str, address: str) -> dict[str, Any]:
    """The ``app=secret`` pod on node-1, with ``address`` asked for (tabby.io/ipAddrs)."""
    return kube.sleeper_pod(
        "secret",
        ns,
        {"app": "secret"},
        nodeName="node-1",
        annotations={"tabby.io/ipAddrs": json.dumps([address])},
    )
