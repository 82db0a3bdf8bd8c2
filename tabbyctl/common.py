"""What more than one tabbyctl command uses, spelled once: the options they share (``-o``,
``--run-dir``), the output of a listing, the one-line errors, the context with the settings."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

import click

from tabby_node import DEFAULT_RUN_DIR

if TYPE_CHECKING:
    from tabbyctl.views import Settings

F = TypeVar("F", bound=Callable[..., object])


def output_option(fn: F) -> F:
    """``-o table|json``: every listing takes it."""
    return click.option(
        "-o",
        "--output",
        type=click.Choice(["table", "json"]),
        default="table",
        show_default=True,
        help="output format",
    )(fn)


def run_dir_option(fn: F) -> F:
    """``--run-dir``: where this node's tabby-node keeps its socket and status."""
    return click.option(
        "--run-dir",
        default=DEFAULT_RUN_DIR,
        show_default=True,
        envvar="TABBY_RUN_DIR",
        help="tabby-node's run directory (env TABBY_RUN_DIR)",
    )(fn)


def emit(output: str, data: object, lines: list[str]) -> None:
    if output == "json":
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        for line in lines:
            click.echo(line)


@contextmanager
def operator_errors() -> Iterator[None]:
    """Library failures become one readable line and exit 1."""
    from cni_protocol.errors import CniError
    from dataplane.errors import DataplaneError
    from ipam.core import DatastoreError, StoreError
    from tabbyctl.views import CtlError

    try:
        yield
    except CtlError as e:
        raise click.ClickException(str(e)) from None
    except DatastoreError as e:
        # The file store turns EACCES into a StoreError naming the path: say what to do.
        denied = (os.strerror(errno.EACCES), os.strerror(errno.EPERM))
        hint = ""
        if isinstance(e, StoreError) and os.geteuid() != 0 and any(d in e.reason for d in denied):
            hint = ": run tabbyctl as root"
        raise click.ClickException(f"IPAM store: {e}{hint}") from None
    except (CniError, DataplaneError) as e:
        raise click.ClickException(str(e)) from None
    except PermissionError as e:
        raise click.ClickException(
            f"permission denied: {e.filename or e}: run tabbyctl as root"
        ) from None


class Ctx:
    def __init__(
        self,
        conf: str | None,
        data_dir: str | None,
        node: str | None,
        datastore: dict[str, str | None] | None = None,
    ) -> None:
        self.conf = conf
        self.data_dir = data_dir
        self.node = node
        self.datastore = datastore or {}
        self._settings: Settings | None = None

    def close(self) -> None:
        """The stores the command opened through ``settings()`` closed (the group calls it
        when the command ends)."""
        if self._settings is not None:
            self._settings.close()

    def settings(self) -> Settings:
        if self._settings is None:
            from tabbyctl.views import load_settings

            self._settings = load_settings(
                self.conf, data_dir=self.data_dir, node=self.node, datastore_flags=self.datastore
            )
        return self._settings
