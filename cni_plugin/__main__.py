"""PyInstaller entry script (absolute imports: it runs as __main__ without a package)."""

from cni_plugin.entry import main

main()
