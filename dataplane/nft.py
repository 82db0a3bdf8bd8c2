"""nftables scripts applied in the calling thread's network namespace, each as one atomic
transaction: through libnftables (the library ``nft`` itself is built on) by ctypes, or the
``nft`` program when the library cannot be loaded.

The text is what ``nft -f`` reads; what it says (tabby's policy table, a trace table) is the
caller's: this module applies what it is given and returns what nft printed, or raises
:class:`~dataplane.errors.NftError` when nft refused the transaction (then nothing of it was
applied). Why libnftables and not ``nft -f`` or JSON, measured: ``policy/DESIGN.md``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import threading
from typing import Literal, Protocol

from dataplane.errors import NftError

log = logging.getLogger("tabby.dataplane.nft")


class NftBackend(Protocol):
    name: str

    def run(self, text: str) -> str:
        """Run ``text`` as one transaction in the calling thread's netns; return the output."""
        ...


class NftCli:
    """The ``nft`` program: ``nft -f -`` (one transaction per call)."""

    name = "nft-cli"

    def __init__(self, binary: str = "nft", json: bool = False) -> None:
        self.argv = [binary, *(["-j"] if json else []), "-f", "-"]

    def run(self, text: str) -> str:
        proc = subprocess.run(self.argv, input=text, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise NftError(proc.stderr.strip()[:4000] or f"nft exited {proc.returncode}")
        return proc.stdout


class LibNftables:
    """libnftables (the library ``nft`` itself is built on) through ctypes, one context per
    network namespace (its netlink socket belongs to the namespace it was opened in).

    libnftables waits on its socket with ``select()``, which aborts the whole process
    (glibc's fd_set check) when the socket's descriptor is >= FD_SETSIZE (1024). A context
    is therefore only made while the lowest free descriptor is well below that (the socket
    takes it and keeps it for the context's life); otherwise that namespace is served by
    the ``nft`` CLI. Contexts live as long as this object: use one per process
    (``default_backend()``)."""

    name = "libnftables"
    FD_LIMIT = 1024 - 64

    def __init__(self, library: str = "libnftables.so.1") -> None:
        lib = ctypes.CDLL(library, use_errno=True)
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_free.restype = None
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
        self._lib = lib
        self._ctx: dict[str, int | None] = {}  # None: this namespace uses the CLI
        self._cli = NftCli()
        self._lock = threading.Lock()

    @staticmethod
    def _lowest_free_fd() -> int:
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        os.close(fd)
        return fd

    def _context(self) -> int | None:
        ns = os.readlink("/proc/thread-self/ns/net")
        if ns in self._ctx:
            return self._ctx[ns]
        ctx: int | None = None
        if self._lowest_free_fd() < self.FD_LIMIT:
            raw = self._lib.nft_ctx_new(0)
            if not raw:
                raise NftError("nft_ctx_new failed")
            ctx = int(raw)
            self._lib.nft_ctx_buffer_output(ctx)
            self._lib.nft_ctx_buffer_error(ctx)
        else:
            log.warning("too many open files for libnftables (select); using the nft CLI")
        self._ctx[ns] = ctx
        return ctx

    def run(self, text: str) -> str:
        with self._lock:
            ctx = self._context()
            if ctx is not None:
                rc = self._lib.nft_run_cmd_from_buffer(ctx, text.encode())
                out = (self._lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
                err = (self._lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace")
        if ctx is None:
            return self._cli.run(text)
        if rc != 0:
            raise NftError(err.strip()[:4000] or f"libnftables returned {rc}")
        return out

    def close(self) -> None:
        with self._lock:
            for ctx in self._ctx.values():
                if ctx is not None:
                    self._lib.nft_ctx_free(ctx)
            self._ctx.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: S110 - interpreter shutdown: nothing left to do
            pass


_default: NftBackend | None = None
_default_lock = threading.Lock()


def default_backend() -> NftBackend:
    """The process-wide backend: libnftables when the library loads (it is what ``nft``
    links against), else the CLI."""
    global _default
    with _default_lock:
        if _default is None:
            try:
                _default = LibNftables()
            except OSError:
                _default = NftCli()
        return _default


Mechanism = Literal["libnftables", "nft-cli", "nft-cli-json"]


def backend_named(name: Mechanism) -> NftBackend:
    if name == "libnftables":
        return LibNftables()
    return NftCli(json=name == "nft-cli-json")


__all__ = [
    "LibNftables",
    "Mechanism",
    "NftBackend",
    "NftCli",
    "NftError",
    "backend_named",
    "default_backend",
]
