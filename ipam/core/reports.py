"""The operator's value types: usage tables, ownership, consistency findings, the report of
``release_node``. Kept out of ``model`` so that a CNI call, which never needs them, does not
define them (each ``NamedTuple`` costs ~0.1 ms of start-up); ``ipam.core`` and
``ipam.core.model`` still export them (loaded on first access)."""

from __future__ import annotations

from typing import NamedTuple

from bundle.types import JSON, IPAddress


class NodeRelease(NamedTuple):
    """What ``Ipam.release_node`` did for a node that is gone."""

    node: str
    released: list[str]  # handle ids released (every address of each)
    addresses: list[str]  # the addresses those releases freed
    deleted_blocks: list[str]  # the node's empty blocks, deleted
    unaffined_blocks: list[str]  # its blocks still holding addresses: now affine to no node
    affinity_deleted: bool  # its affinity document was deleted
    errors: list[str]  # one per failure; the release went on after each


class Problem(NamedTuple):
    """One finding of ``check_consistency``.

    ``severity`` is "error" (an invariant is broken: fix by hand) or "leftover" (a harmless
    crash leftover that the next DEL/GC/ADD touching it repairs).
    """

    severity: str
    kind: str
    subject: str
    message: str


class PoolUsage(NamedTuple):
    cidr: str
    block_size: int
    disabled: bool
    total: int
    in_use: int
    reserved: int  # reserved and not in use
    free: int  # total - in_use - reserved
    blocks: int  # blocks existing in the store


class BlockUsage(NamedTuple):
    cidr: str
    pool: str
    node: str | None  # affinity; None = not affine to any node
    in_use: int
    free: int  # excluding reserved addresses


class IpOwner(NamedTuple):
    ip: IPAddress
    block_cidr: str
    node: str | None  # the block's affinity
    handle_id: str
    seq: int
    attrs: JSON
