"""Run one harness under atheris (libFuzzer): ``python -m tests.fuzz.<target> [flags]
[corpus dirs]``. The product's loaded code (the packages ``packages`` names) is instrumented
for coverage, so the fuzzer learns which inputs reach new branches; libraries are not (all
of them would cost minutes of instrumentation on a 2-core machine and steer the fuzzer into
pydantic's and hypothesis' branches). A crash (anything ``fuzz_one`` raises) stops the run
with libFuzzer's report and leaves the input as ``crash-<sha1>`` in the working directory:
it becomes a regression test next to the module's tests and a seed of the target's corpus.
"""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Callable, Iterable


def instrument(packages: Iterable[str]) -> int:
    """Instrument every loaded function of ``packages`` (top-level names); how many."""
    import atheris

    wanted = tuple(packages)
    count = 0
    for obj in gc.get_objects():
        if isinstance(obj, types.FunctionType):
            module = (getattr(obj, "__module__", None) or "").split(".")[0]
            if module in wanted:
                atheris.instrument_func(obj)
                count += 1
    return count


def main(fuzz_one: Callable[[bytes], None], packages: Iterable[str]) -> None:
    import atheris

    print(f"tabby fuzz: {instrument(packages)} functions instrumented", file=sys.stderr)
    atheris.Setup(list(sys.argv), fuzz_one)
    atheris.Fuzz()
