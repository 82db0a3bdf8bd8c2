"""CNI_ARGS (``K=V;K=V``) parsed leniently (CONFORMANCE.md ENV-7, KARG-1)."""

from __future__ import annotations


def parse_cni_args(raw: str) -> dict[str, str]:
    """Split on ';' and on the first '='; ignore empty and malformed pairs and unknown keys.

    libcni's strict parser rejects unknown keys unless ``IgnoreUnknown`` is set; runtimes
    add keys freely, so tabby never fails on them (ENV-7). Later duplicates win.
    """
    out: dict[str, str] = {}
    for pair in raw.split(";"):
        key, sep, value = pair.partition("=")
        key = key.strip()
        if sep and key:
            out[key] = value.strip()
    return out


def with_ignore_unknown(raw: str) -> str:
    """CNI_ARGS with ``IgnoreUnknown=1`` present, for a delegate with a strict parser (IPM-6)."""
    if "IgnoreUnknown" in parse_cni_args(raw):
        return raw
    return f"IgnoreUnknown=1;{raw}" if raw else "IgnoreUnknown=1"
