"""Building on Debian, as the product image and the lab's Kubernetes build both do.

Build tooling, not shipped (``packaging/image.py`` bootstraps the image's root from the
machine's ``deb`` entries; ``lab.kubernetes.build`` fetches Kubernetes' source from a
``deb-src`` entry derived the same way), standard library only:

* the machine's apt sources, one-line and deb822 style (:func:`machine_apt_sources`), the
  entries of a suite derived from them (:func:`suite_entries`), rendered as deb822;
* dpkg's version order (:func:`compare_debian_versions`);
* the flock a cache is built under (:func:`cache_lock`).

``packaging/`` is not a package (a ``packaging/__init__.py`` would shadow PyPI's
``packaging``): this module is imported by its name with ``packaging/`` on ``sys.path``
(``packaging/image.py`` as a script, ``lab`` on import, the tests by pytest's
``pythonpath``).
"""

from __future__ import annotations

import contextlib
import fcntl
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: The Debian release tabby builds on: the image's root, the lab's Kubernetes source.
SUITE = "bookworm"
APT_SOURCES_DIR = Path("/etc/apt/sources.list.d")
APT_SOURCES_LIST = Path("/etc/apt/sources.list")

Log = Callable[[str], None]


class SourcesError(RuntimeError):
    """The machine's apt sources do not give what a build needs (the message says what)."""


# --- versions ---------------------------------------------------------------------------------


def _dpkg_order(c: str) -> int:
    if c == "~":
        return -1
    if c == "" or c.isdigit():
        return 0
    if c.isalpha():
        return ord(c)
    return ord(c) + 256


def _dpkg_verrevcmp(a: str, b: str) -> int:
    """dpkg's verrevcmp() of an upstream version or a revision."""
    i = j = 0
    while i < len(a) or j < len(b):
        while (i < len(a) and not a[i].isdigit()) or (j < len(b) and not b[j].isdigit()):
            ac = _dpkg_order(a[i] if i < len(a) else "")
            bc = _dpkg_order(b[j] if j < len(b) else "")
            if ac != bc:
                return ac - bc
            i += 1
            j += 1
        n = i
        while n < len(a) and a[n].isdigit():
            n += 1
        m = j
        while m < len(b) and b[m].isdigit():
            m += 1
        diff = int(a[i:n] or "0") - int(b[j:m] or "0")
        if diff:
            return diff
        i, j = n, m
    return 0


def compare_debian_versions(a: str, b: str) -> int:
    """<0, 0 or >0 as Debian version a sorts before, with or after b (like dpkg)."""

    def split(v: str) -> tuple[int, str, str]:
        epoch, _, rest = v.partition(":") if ":" in v else ("0", "", v)
        upstream, _, revision = rest.rpartition("-") if "-" in rest else (rest, "", "")
        return int(epoch or "0"), upstream, revision

    ea, ua, ra = split(a)
    eb, ub, rb = split(b)
    if ea != eb:
        return ea - eb
    return _dpkg_verrevcmp(ua, ub) or _dpkg_verrevcmp(ra, rb)


# --- the cache lock -------------------------------------------------------------------------


@contextlib.contextmanager
def cache_lock(path: Path, log: Log, waiting: str) -> Iterator[None]:
    """An exclusive flock on ``path`` (made, with its directory) while a cache is built;
    ``waiting`` is logged when another build holds it (also the image's root cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(waiting)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- apt sources ----------------------------------------------------------------------------


@dataclass
class AptSource:
    types: tuple[str, ...]
    uris: tuple[str, ...]
    suites: tuple[str, ...]
    components: tuple[str, ...]
    # Lower-case option name -> raw deb822 value: the text after "Name:", continuation lines
    # included verbatim (a Signed-By may hold a whole armoured key).
    options: dict[str, str] = field(default_factory=dict)


# The options carried onto a deb-src entry (those about fetching and trusting an index):
# one-line option name -> deb822 field name.
_OPTION_NAMES = {
    "signed-by": "Signed-By",
    "trusted": "Trusted",
    "check-valid-until": "Check-Valid-Until",
    "check-date": "Check-Date",
    "allow-insecure": "Allow-Insecure",
    "allow-weak": "Allow-Weak",
    "allow-downgrade-to-insecure": "Allow-Downgrade-To-Insecure",
    "date-max-future": "Date-Max-Future",
    "valid-until-min": "Valid-Until-Min",
    "valid-until-max": "Valid-Until-Max",
}
_CARRIED_OPTIONS = frozenset(_OPTION_NAMES)


def parse_one_line_sources(text: str) -> list[AptSource]:
    """The entries of a one-line-style sources.list."""
    result = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        kind, _, rest = line.partition(" ")
        rest = rest.strip()
        options: dict[str, str] = {}
        if rest.startswith("["):
            inside, sep, rest = rest[1:].partition("]")
            if not sep:
                continue
            for opt in inside.split():
                key, _, value = opt.partition("=")
                options[key.lower()] = " " + value.replace(",", " ")
        words = rest.split()
        if len(words) < 2:
            continue
        result.append(AptSource((kind,), (words[0],), (words[1],), tuple(words[2:]), options))
    return result


def parse_deb822_sources(text: str) -> list[AptSource]:
    """The enabled entries of a deb822-style .sources file."""
    result = []
    for stanza in re.split(r"\n[ \t]*\n", text):
        fields: dict[str, str] = {}
        key: str | None = None
        for line in stanza.splitlines():
            if line.startswith("#"):
                continue
            if line[:1] in (" ", "\t") and key is not None:
                fields[key] += "\n" + line
                continue
            name, sep, value = line.partition(":")
            if not sep:
                key = None
                continue
            key = name.strip().lower()
            fields[key] = value

        def words(name: str, fields: dict[str, str] = fields) -> tuple[str, ...]:
            return tuple(fields.get(name, "").split())

        if not words("types") or words("enabled") == ("no",):
            continue
        known = ("types", "uris", "suites", "components", "enabled")
        options = {k: v for k, v in fields.items() if k not in known}
        result.append(
            AptSource(words("types"), words("uris"), words("suites"), words("components"), options)
        )
    return result


def machine_apt_sources(skip_prefix: str = "") -> list[AptSource]:
    """The machine's apt entries, from /etc/apt/sources.list and sources.list.d/*.{list,sources};
    ``skip_prefix``: files of a build of ours (a leftover), never derived from."""
    found: list[AptSource] = []
    files = [APT_SOURCES_LIST]
    with contextlib.suppress(OSError):
        files += sorted(APT_SOURCES_DIR.iterdir())
    for path in files:
        if skip_prefix and path.name.startswith(skip_prefix):
            continue
        try:
            text = path.read_text()
        except OSError:
            continue
        if path.suffix == ".list" or path == APT_SOURCES_LIST:
            found += parse_one_line_sources(text)
        elif path.suffix == ".sources":
            found += parse_deb822_sources(text)
    return found


def suite_entries(sources: Sequence[AptSource], suite: str, kind: str) -> list[AptSource]:
    """Entries of type `kind` (``deb`` or ``deb-src``) for `suite`, `suite`-updates and
    `suite`-security (main), derived from the machine's ``deb`` entries: `suite` and
    `suite`-updates on the mirror that serves `suite` main, `suite`-security on its own
    mirror if the machine uses one (packaging/image.py bootstraps its root from the ``deb``
    ones, lab.kubernetes.build fetches Kubernetes' source from the ``deb-src`` ones)."""

    def find(s: str) -> AptSource | None:
        for src in sources:
            usable = bool(src.uris) and not src.uris[0].startswith("cdrom:")
            if usable and "deb" in src.types and s in src.suites and "main" in src.components:
                return src
        return None

    base = find(suite)
    if base is None:
        raise SourcesError(f"no 'deb <mirror> {suite} main' entry in the machine's apt sources")
    grouped: dict[tuple[str, tuple[tuple[str, str], ...]], list[str]] = {}
    for s in (suite, f"{suite}-updates", f"{suite}-security"):
        src = find(s) or (base if s == f"{suite}-updates" else None)
        if src is not None:
            carried = {k: v for k, v in src.options.items() if k in _CARRIED_OPTIONS}
            key = (src.uris[0], tuple(sorted(carried.items())))
            grouped.setdefault(key, []).append(s)
    return [
        AptSource((kind,), (uri,), tuple(suites), ("main",), dict(options))
        for (uri, options), suites in grouped.items()
    ]


def render_deb822(entries: Sequence[AptSource]) -> str:
    stanzas = []
    for e in entries:
        lines = [
            f"Types: {' '.join(e.types)}",
            f"URIs: {' '.join(e.uris)}",
            f"Suites: {' '.join(e.suites)}",
            f"Components: {' '.join(e.components)}",
        ]
        for key, raw in e.options.items():
            lines.append(f"{_OPTION_NAMES.get(key, key.title())}:{raw}")
        stanzas.append("\n".join(lines) + "\n")
    return "\n".join(stanzas)
