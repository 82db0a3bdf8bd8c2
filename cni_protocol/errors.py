"""CNI error codes and the one exception type every layer turns its failures into.

Codes 0-99 are the spec's (CNI spec §5, "Error"); tabby's own start at 100. What each
one means: docs/configuration.md "Error codes".
"""

from __future__ import annotations

import enum
import json


class Code(enum.IntEnum):
    INCOMPATIBLE_VERSION = 1
    UNSUPPORTED_FIELD = 2
    UNKNOWN_CONTAINER = 3
    INVALID_ENV = 4
    IO_FAILURE = 5
    DECODE_FAILURE = 6
    INVALID_CONFIG = 7
    INVALID_NETNS = 8
    TRY_AGAIN_LATER = 11
    NOT_READY = 50
    NOT_READY_DEGRADED = 51
    # tabby's own (docs/configuration.md "Error codes")
    NO_ADDRESS = 100
    STORE_CORRUPT = 101
    ADDRESS_UNAVAILABLE = 102
    DATAPLANE = 103
    DELEGATE_FAILED = 104
    INTERNAL = 999


class CniError(Exception):
    """A failure that is reported to the runtime as one CNI error object.

    ``details`` is the longer explanation; ``msg`` stays short (spec section 5, "Error").
    """

    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code = int(code)
        self.msg = msg
        self.details = details

    def to_dict(self, cni_version: str) -> dict[str, object]:
        out: dict[str, object] = {"cniVersion": cni_version, "code": self.code, "msg": self.msg}
        if self.details:
            out["details"] = self.details
        return out

    def to_json(self, cni_version: str) -> str:
        return json.dumps(self.to_dict(cni_version), separators=(",", ":"))

    def __str__(self) -> str:
        return f"{self.msg}: {self.details}" if self.details else self.msg

    def __repr__(self) -> str:
        return f"CniError({self.code}, {self.msg!r}, {self.details!r})"
