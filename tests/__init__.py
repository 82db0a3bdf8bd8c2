from pathlib import Path

#: The repository's root (tests/ is a package of it, imported as ``tests``).
REPO_ROOT = Path(__file__).resolve().parent.parent
