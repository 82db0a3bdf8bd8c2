"""The dataplane's errors as CNI errors: the one table the ``tabby`` plugin's verbs use at
their edge (the dataplane knows nothing of CNI codes; PRODUCT codes in the README), and the
dataplane as the verbs see it (:class:`CniDataplane`: every call's dataplane error raised as
its CNI error). Standard library, the protocol layer and ``dataplane.errors`` only: cheap
for the CNI binary to import."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from cni_protocol.errors import CniError, Code
from dataplane.errors import (
    DataplaneError,
    InvalidNetNS,
    InvalidVethPrefix,
    NetNSNotFound,
)

if TYPE_CHECKING:
    from bundle.types import IPAddress
    from dataplane.model import (
        Dataplane,
        ExpectedState,
        HostVeth,
        SetupResult,
        SetupSpec,
    )

# The most specific class wins (the table is walked along the MRO). The message and the
# details are the error's own.
CODES: dict[type[DataplaneError], int] = {
    # CNI_NETNS is gone: the container is (DEL treats it as done).
    NetNSNotFound: Code.UNKNOWN_CONTAINER,
    # CNI_NETNS is not a network namespace, or the plugin's own (GEN-16 of
    # cni_protocol/CONFORMANCE.md).
    InvalidNetNS: Code.INVALID_NETNS,
    # veth_prefix is checked by the configuration models first; this is the same rule.
    InvalidVethPrefix: Code.UNSUPPORTED_FIELD,
    # Everything else the kernel refused or did not have: netlink, sysctl, a name taken,
    # CHECK's mismatches.
    DataplaneError: Code.DATAPLANE,
}


def to_cni_error(e: DataplaneError) -> CniError:
    """The CNI error for a dataplane error: the code of its most specific class in
    ``CODES``, its message and details."""
    code = next(CODES[cls] for cls in type(e).__mro__ if cls in CODES)
    return CniError(code, e.msg, e.details)


@contextmanager
def cni_errors() -> Iterator[None]:
    """The block's dataplane errors raised as their CNI errors."""
    try:
        yield
    except DataplaneError as e:
        raise to_cni_error(e) from None


class CniDataplane:
    """A :class:`~dataplane.model.Dataplane` whose errors are CNI errors: what the plugin's
    verbs call (an error that is already a ``CniError``, e.g. a test's fake, passes
    unchanged)."""

    def __init__(self, inner: Dataplane) -> None:
        self.inner = inner

    def setup(
        self, spec: SetupSpec, addresses: Callable[[], Sequence[IPAddress]] | None = None
    ) -> SetupResult:
        with cni_errors():
            return self.inner.setup(spec, addresses)

    def teardown(
        self,
        netns_path: str | None,
        ifname: str,
        host_ifname: str | None,
        addresses: Sequence[IPAddress] | None = None,
    ) -> None:
        with cni_errors():
            self.inner.teardown(netns_path, ifname, host_ifname, addresses)

    def check(self, spec: SetupSpec, expected: ExpectedState | None = None) -> None:
        with cni_errors():
            self.inner.check(spec, expected)

    def list_host_veths(self, prefix: str) -> list[HostVeth]:
        with cni_errors():
            return self.inner.list_host_veths(prefix)

    def delete_host_veth(self, name: str) -> None:
        with cni_errors():
            self.inner.delete_host_veth(name)

    def pod_interface_present(self, netns_path: str, ifname: str) -> bool:
        with cni_errors():
            return self.inner.pod_interface_present(netns_path, ifname)


__all__ = ["CODES", "CniDataplane", "cni_errors", "to_cni_error"]
