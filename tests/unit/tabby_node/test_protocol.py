"""tabby-node's wire header and its install files agree with the code."""

from __future__ import annotations

from tabby_node import DEFAULT_SOCKET, decode_header, encode_header
from tests import REPO_ROOT as ROOT


def test_header_round_trip_keeps_env_exactly() -> None:
    env = {
        "CNI_COMMAND": "ADD",
        "CNI_ARGS": "K8S_POD_NAME=a=b;X=",
        "EMPTY": "",
        "UNICODE": "pöd",
        "PATH": "/a:/b",
    }
    version, role, back = decode_header(encode_header("1.2.3", "tabby-ipam", env))
    assert (version, role, back) == ("1.2.3", "tabby-ipam", env)


def test_a_header_without_version_and_role_is_another_version() -> None:
    """Found by fuzzing (tests/fuzz/node_frames.py): a frame with an empty header made
    decode_header raise, and the node logged a traceback for it ("a call failed outside
    the CNI error path") and closed without an answer; it is refused as another version."""
    assert decode_header(b"") == ("", "", {})
    assert decode_header(b"1.2.3") == ("", "", {})
    assert decode_header(b"1.2.3\0tabby") == ("1.2.3", "tabby", {})


def test_systemd_unit_matches_install_paths() -> None:
    unit = (ROOT / "conf-examples" / "tabby-node.service").read_text()
    assert "ExecStart=/usr/local/bin/tabby-node " in unit
    assert "KillMode=process" in unit  # BIRD outlives a tabby-node that dies (adoption)
    from tabby_node.options import NodeOptions

    assert NodeOptions().socket_path == DEFAULT_SOCKET  # the unit relies on the default
    build = (ROOT / "build.sh").read_text()
    assert '"$DESTDIR$BIN_DIR/tabby-node"' in build
