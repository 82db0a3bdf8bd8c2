"""bundle/environ.py: a frozen program's children get the environment it was given, not the
bundle's library path (PyInstaller's bootloader prepends it and saves the original in
LD_LIBRARY_PATH_ORIG). The installed bundle is checked by tests/e2e/test_bundle_env.py."""

from __future__ import annotations

import pytest

from bundle import environ

MEIPASS = "/opt/tabby/bundles/0.1.0-abc/_internal"


@pytest.mark.parametrize(
    ("given", "wanted"),
    [
        # no library path given: the bootloader made one (exactly the bundle's): gone
        ({"LD_LIBRARY_PATH": MEIPASS, "A": "1"}, {"A": "1"}),
        # containerd's own path: saved by the bootloader, put back
        (
            {
                "LD_LIBRARY_PATH": f"{MEIPASS}:/var/lib/containerd/opt/lib:",
                "LD_LIBRARY_PATH_ORIG": "/var/lib/containerd/opt/lib:",
            },
            {"LD_LIBRARY_PATH": "/var/lib/containerd/opt/lib:"},
        ),
        # an empty value was given: empty it stays
        (
            {"LD_LIBRARY_PATH": f"{MEIPASS}:", "LD_LIBRARY_PATH_ORIG": ""},
            {"LD_LIBRARY_PATH": ""},
        ),
        # already restored (a child of a restored parent): nothing to do
        ({"LD_LIBRARY_PATH": "/usr/local/lib"}, {"LD_LIBRARY_PATH": "/usr/local/lib"}),
        ({"PATH": "/bin"}, {"PATH": "/bin"}),
    ],
    ids=["made-by-bootloader", "saved-original", "saved-empty", "foreign", "none"],
)
def test_original_environment(given: dict[str, str], wanted: dict[str, str]) -> None:
    assert environ.original(given, MEIPASS) == wanted


def test_not_frozen_changes_nothing() -> None:
    env = {"LD_LIBRARY_PATH": "/x", "LD_LIBRARY_PATH_ORIG": "/y"}
    assert environ.original(env, None) == env
    assert environ.bundle_dir() is None  # the tests run from the checkout
    before = dict(env)
    environ.restore(env)
    assert env == before


def test_restore_changes_the_mapping_in_place() -> None:
    env = {
        "LD_LIBRARY_PATH": f"{MEIPASS}:/opt/lib",
        "LD_LIBRARY_PATH_ORIG": "/opt/lib",
        "CNI_COMMAND": "ADD",
    }
    environ.restore(env, MEIPASS)
    assert env == {"LD_LIBRARY_PATH": "/opt/lib", "CNI_COMMAND": "ADD"}
    env = {"LD_LIBRARY_PATH": MEIPASS}
    environ.restore(env, MEIPASS)
    assert env == {}
