"""Options more than one tabbyctl command takes, spelled once (imports only click)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from cni_plugin.node import DEFAULT_RUN_DIR

F = TypeVar("F", bound=Callable[..., Any])


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
