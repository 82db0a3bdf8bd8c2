"""pyroute2 loads without its package __init__, and other code still sees the full package."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = """
import sys
from dataplane import rtnl
assert "pyroute2.ndb.main" not in sys.modules, "package __init__ ran"
assert "pyroute2.ipdb" not in sys.modules
assert "asyncio" not in sys.modules, "the message classes alone need no event loop"
from pyroute2 import config                      # a submodule: no full init
assert "pyroute2.ndb.main" not in sys.modules
from pyroute2 import IPRoute, NDB                # names of the real __init__: full init now
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
assert ifinfmsg is rtnl.ifinfmsg
assert IPRoute.__module__.startswith("pyroute2.")
print("ok")
"""


def test_lazy_package_is_complete_when_needed() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
