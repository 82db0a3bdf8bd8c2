"""The lab: what the test tiers and the benches run tabby on, beyond the shipped demos.

Not product: nothing in the product imports it and the bundle does not carry it. It runs
from a checkout of the repository.

::

    kubernetes   a real Kubernetes on the demos' lab (``tabbyctl.demo.lab``, which the
                 cluster tier and the benches use directly): control plane, containerd and
                 kubelet per node in a mount namespace of its own, tabby as its network;
                 ``python -m lab.kubernetes.demo`` shows it

It shares the OCI packer and the apt-source helpers with the product image
(``packaging/ocipack.py``, ``packaging/debbuild.py``: build tooling, not shipped);
importing ``lab`` puts ``packaging/`` on ``sys.path`` for them (a ``packaging/__init__.py``
would shadow PyPI's ``packaging``, which pip, pytest and PyInstaller import).

Nothing here touches a real node's state: every lab uses its own namespaces, data
directories, network names and ports, and removes everything, also on Ctrl-C.
"""

import os
import sys

PACKAGING = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "packaging")
if PACKAGING not in sys.path:
    sys.path.append(PACKAGING)
