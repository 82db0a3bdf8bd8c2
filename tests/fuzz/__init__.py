"""Fuzz harnesses for every parser that takes outside input (docs/testing.md "Fuzzing").

One module per target family. Each states its property once, as ``fuzz_one(data: bytes)``
(raises ``AssertionError`` when the property fails; anything else it raises is a crash) and,
where inputs have structure, as hypothesis strategies. The two ways to run a target:

- as property tests of the unit tier (``tests/unit/<package>/test_fuzz_*.py``): hypothesis
  examples, a bounded number, deterministic (:data:`PROFILE`); the corpus seeds replayed;
- coverage-guided, ``python -m tests.fuzz.<target> [libFuzzer flags] [corpus dir]``
  (atheris; ``tests/run.sh`` runs every target for a few seconds with its corpus:
  :data:`TARGETS`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from hypothesis import HealthCheck, settings

CORPUS = Path(__file__).resolve().parent / "corpus"
#: The atheris targets: module name under tests.fuzz (its corpus: corpus/<name>/).
TARGETS = (
    "cni",
    "node_frames",
    "etcd_grpc",
    "documents",
    "selector",
    "apply_yaml",
    "bird_render",
    "nft_render",
)

#: The unit tier's hypothesis settings: deterministic (a red run is red again), no
#: database written into the tree, no deadline (a shared 2-core machine), and few examples
#: per property in a developer's run (--quick); a full run (tests/conftest.py: a tier's
#: option or --run-slow) takes FULL_PROFILE's. TABBY_FUZZ_EXAMPLES sets the number.
PROFILE = "tabby-unit"
FULL_PROFILE = "tabby-full"
_EXAMPLES = os.environ.get("TABBY_FUZZ_EXAMPLES")
for _name, _examples in ((PROFILE, 40), (FULL_PROFILE, 200)):
    settings.register_profile(
        _name,
        max_examples=int(_EXAMPLES) if _EXAMPLES else _examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
settings.load_profile(PROFILE)


def seeds(target: str) -> list[bytes]:
    """The corpus kept for ``target`` (every file of corpus/<target>/), sorted by name."""
    folder = CORPUS / target
    return [p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()]


def seed_ids(target: str) -> list[str]:
    return [p.name for p in sorted((CORPUS / target).iterdir()) if p.is_file()]


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """No logging while a hostile input is handled: what the product logs of it (a raw
    lone surrogate from an environment variable, say) is not the property, and pytest-xdist
    cannot send a captured log holding one back from its workers."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)
