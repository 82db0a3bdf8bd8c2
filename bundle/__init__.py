"""The one frozen bundle every tabby program runs from, and its version.

``bundle.entry`` picks the program from the name it was exec'd as (``tabby``, ``tabby-ipam``,
``tabbyctl``, ``tabby-node``, ``tabby-kube-controllers``); ``bundle/__main__.py`` is
PyInstaller's entry script. This module holds only the version, so that every layer may
import it; ``bundle.types`` likewise holds only the types every layer shares.
"""

__version__ = "0.1.0"
