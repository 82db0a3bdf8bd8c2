"""tabby-node's BIRD 2 backend: BGP routes for the node's blocks (Calico's confd + BIRD role).

The node agent computes the typed inputs (:mod:`.model`) from the datastore; this package
renders them into BIRD configuration (:mod:`.render`), keeps one BIRD running under the
agent's run directory and reloads it on change (:mod:`.supervisor`), and reads BIRD's
state back over its control socket for ``node status`` and readiness (:mod:`.control`).

    sup = BirdSupervisor(run_dir)
    sup.start(BirdConfig(node=BirdNode("node-a", IPv4Address("10.0.0.1")), peers=..., ...))
    sup.apply(new_config)   # on every datastore change; a no-op when the text is the same
    sup.peers(); sup.readiness()
    sup.stop(graceful=True) # on SIGTERM: peers keep the routes until the next BIRD; SIGKILL
                            # of tabby-node leaves BIRD running for the next one to adopt
"""

from __future__ import annotations

from bird.control import (
    BirdCommandError,
    BirdControl,
    BirdError,
    BirdStatus,
    BirdUnavailable,
    PeerStatus,
    ProtocolStatus,
    SinceMemo,
    peer_statuses,
    read_peers,
    read_status,
    readiness,
)
from bird.model import (
    DEFAULT_AS,
    BirdConfig,
    BirdNode,
    LogSeverity,
    Peer,
    PeerType,
    Pool,
)
from bird.render import parse_protocol_name, protocol_name, render
from bird.supervisor import (
    CONF_NAME,
    CTL_NAME,
    LOG_NAME,
    PID_NAME,
    BirdConfigError,
    BirdStartError,
    BirdSupervisor,
    RunPaths,
    check_config,
    find_bird,
)

__all__ = [
    "CONF_NAME",
    "CTL_NAME",
    "DEFAULT_AS",
    "LOG_NAME",
    "PID_NAME",
    "BirdCommandError",
    "BirdConfig",
    "BirdConfigError",
    "BirdControl",
    "BirdError",
    "BirdNode",
    "BirdStartError",
    "BirdStatus",
    "BirdSupervisor",
    "BirdUnavailable",
    "LogSeverity",
    "Peer",
    "PeerStatus",
    "PeerType",
    "Pool",
    "ProtocolStatus",
    "RunPaths",
    "SinceMemo",
    "check_config",
    "find_bird",
    "parse_protocol_name",
    "peer_statuses",
    "protocol_name",
    "read_peers",
    "read_status",
    "readiness",
    "render",
]
