"""Spec versions tabby implements end to end (CONFORMANCE.md VER-3) and how to compare them."""

from __future__ import annotations

from .errors import CniError, Code

SUPPORTED_VERSIONS: tuple[str, ...] = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
CURRENT = "1.1.0"


def parse(version: object) -> tuple[int, int, int]:
    """Parse a ``major.minor.patch`` string; anything else is a decode failure (code 6)."""
    if not isinstance(version, str):
        raise CniError(Code.DECODE_FAILURE, "invalid cniVersion", f"cniVersion {version!r}")
    parts = version.split(".")
    # isascii: str.isdigit() is true for digits int() refuses ("²"), and for other scripts'.
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() for p in parts):
        raise CniError(Code.DECODE_FAILURE, "invalid cniVersion", f"cniVersion {version!r}")
    return int(parts[0]), int(parts[1]), int(parts[2])


def at_least(version: str, minimum: str) -> bool:
    return parse(version) >= parse(minimum)


def is_legacy(version: str) -> bool:
    """True for the 0.3.x/0.4.0 result shape (``ips[].version`` present)."""
    return parse(version) < (1, 0, 0)


def version_reply(requested: object) -> dict[str, object]:
    """The VERSION answer: echo the request's version when we know it (VER-2), else ours."""
    echoed = requested if requested in SUPPORTED_VERSIONS else CURRENT
    return {"cniVersion": echoed, "supportedVersions": list(SUPPORTED_VERSIONS)}
