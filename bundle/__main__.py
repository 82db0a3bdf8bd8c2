"""PyInstaller entry script (absolute imports: it runs as __main__ without a package)."""

from bundle.entry import main

main()
