"""NetworkPolicy through kubectl on real pods: the Kubernetes e2e truth table's cases that
Kubernetes 1.20 can express (no ``endPort``), with pods x/a .. z/c spread over the 3 nodes,
policies applied with ``kubectl apply``, label changes made with ``kubectl label``, and
tabby-kube-controllers carrying them to tabby (tests/kubernetes/netpol.py). Every case on
the BIRD cluster, a few on VXLAN."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lab.kubernetes.cluster import KubeLab
from lab.kubernetes.controllers import Controllers
from tests import policy_truth_table as tt
from tests.cluster import policy_lab as pl
from tests.kubernetes.netpol import CASES, KubeTruthTable

pytestmark = pytest.mark.kubernetes

#: On VXLAN: live namespace and pod label changes, named ports, an egress case.
VXLAN_CASES = {17, 19, 21, 22}
SETTLE_SECONDS = 10.0
_TABLES: dict[str, KubeTruthTable] = {}


@pytest.fixture
def table(kube_lab: KubeLab, controllers: Controllers) -> KubeTruthTable:
    """The truth table's namespaces and pods on this cluster (made once), all open."""
    for prefix in [p for p in _TABLES if p != kube_lab.prefix]:
        del _TABLES[prefix]  # that cluster is gone (its teardown stopped the servers)
    t = _TABLES.get(kube_lab.prefix)
    if t is None:
        t = _TABLES[kube_lab.prefix] = KubeTruthTable.build_on(kube_lab)
        bad, _ = t.settle(pl.ALL_OPEN, 60)
        assert not bad, f"the pods do not reach each other: {bad[:10]}"
    return t


@pytest.fixture(scope="module", autouse=True)
def _close_tables() -> Iterator[None]:
    yield
    for t in _TABLES.values():
        t.close()
    _TABLES.clear()


def _run(table: KubeTruthTable, case: tt.Case) -> None:
    try:
        for i, step in enumerate(case.steps):
            table.apply_step(step)
            bad, _ = table.settle(pl.expected_matrix(step), SETTLE_SECONDS)
            assert not bad, f"step {i}: {len(bad)} mismatches:\n" + "\n".join(bad[:30])
    finally:
        table.reset()
        bad, _ = table.settle(pl.ALL_OPEN, SETTLE_SECONDS)
        assert not bad, "after deleting the case's policies:\n" + "\n".join(bad[:30])


@pytest.mark.parametrize("kube_lab", ["bird"], indirect=True)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_e2e_netpol_through_kubectl_bird(table: KubeTruthTable, case: tt.Case) -> None:
    _run(table, case)


@pytest.mark.parametrize("kube_lab", ["vxlan"], indirect=True)
@pytest.mark.parametrize("case", [c for c in CASES if c.number in VXLAN_CASES], ids=lambda c: c.id)
def test_e2e_netpol_through_kubectl_vxlan(table: KubeTruthTable, case: tt.Case) -> None:
    _run(table, case)
