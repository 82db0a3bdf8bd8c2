"""The Kubernetes tier: a real Kubernetes 1.20 (lab.kubernetes.cluster.KubeLab: control plane
on node-1, containerd + kubelet + tabby-node on 3 nodes, a 3-member etcd) with tabby as its
pod network, driven with kubectl.

``kube_lab`` is one cluster per backend for the whole session, built when the first test
needs it, each on its own datastore (``DATASTORES``): bird on the Kubernetes datastore, as
manifests/tabby.yaml ships (nothing of tabby in etcd), vxlan on etcd (the manifest's one
ConfigMap change); pytest runs every test of one backend before it builds the next, and
tears each cluster down (then checks the machine: nothing may be left) before the next one
comes up. A test that needs one backend only says so with
``@pytest.mark.parametrize("kube_lab", ["bird"], indirect=True)``.

tests/kubernetes/test_manifest.py brings up clusters of its own, with no network until it
installs tabby with manifests/tabby.yaml; its tests run first (before the lab clusters above
exist), one cluster at a time.

Needs root, the installed binaries (./build.sh --no-demo), Kubernetes built by
``python -m lab.kubernetes.build`` and the Debian packages lab.kubernetes.cluster.TOOLS names
(tests/run.sh does all of it): ``.venv/bin/pytest --run-kubernetes tests/kubernetes``.
Without --run-kubernetes the tier is skipped; with it, anything missing is a failure.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from lab.kubernetes import build
from lab.kubernetes.cluster import KubeLab
from lab.kubernetes.controllers import Controllers
from tabbyctl.demo.proc import LabError

BACKENDS = ("bird", "vxlan")
#: The datastore of each backend's cluster (test_manifest.py pairs them the same way).
DATASTORES = {"bird": "kubernetes", "vxlan": "etcdv3"}


def _prerequisites() -> None:
    if os.geteuid() != 0:
        pytest.fail("the Kubernetes tier needs root")
    if build.find_binaries() is None:
        pytest.fail("Kubernetes is not built: python -m lab.kubernetes.build (tests/run.sh does)")


@pytest.fixture(scope="session", params=BACKENDS)
def kube_lab(request: pytest.FixtureRequest) -> Iterator[KubeLab]:
    _prerequisites()
    # --node-ttl 15: a node that stops is withdrawn (and, deleted, released) within seconds
    lab = KubeLab(
        backend=request.param,
        datastore=DATASTORES[request.param],
        node_args=["--node-ttl", "15"],
    )
    try:
        try:
            lab.build()
        except LabError as e:
            pytest.fail(f"the {request.param} cluster did not come up: {e}")
        yield lab
    finally:
        problems = lab.teardown()
        assert not problems, f"the {request.param} cluster left things behind: {problems}"


#: tabby-kube-controllers of each cluster (by its prefix), started by the first test that
#: needs them; the cluster's teardown stops them (they are its processes).
_CONTROLLERS: dict[str, Controllers] = {}


@pytest.fixture
def controllers(kube_lab: KubeLab) -> Controllers:
    """Two replicas (node-1, node-2) with the manifest's service account and RBAC, one of
    them leading, both ready; a replica a test stopped is started again."""
    c = _CONTROLLERS.get(kube_lab.prefix)
    if c is None:
        c = _CONTROLLERS[kube_lab.prefix] = Controllers(kube_lab)
        c.install()
    for identity, node in (("replica-1", "node-1"), ("replica-2", "node-2")):
        replica = c.replicas.get(identity)
        if replica is not None and replica.proc is not None and replica.proc.poll() is None:
            continue
        c.replicas.pop(identity, None)
        c.start(identity, node)
    c.wait_leader()
    c.wait_ready()
    return c


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The manifest's tests first: their clusters come and go before the session's lab
    clusters are built, so that two clusters never run at once. The migration last of this
    tier (it leaves the vxlan cluster on the Kubernetes datastore), in the tier's place:
    the other tiers never run beside a lab cluster."""
    items.sort(key=lambda item: 0 if item.path.name == "test_manifest.py" else 1)
    here = [i for i, item in enumerate(items) if item.path.parent.name == "kubernetes"]
    if not here:
        return
    mine = [items[i] for i in here]
    mine.sort(key=lambda item: item.path.name == "test_migrate.py")
    for i, item in zip(here, mine, strict=True):
        items[i] = item
