"""tabbyctl entry point: a thin click layer over the libraries the binaries use."""

from __future__ import annotations

import json
import sys

import click

from cni_plugin import __version__
from cni_plugin.cni.version import SUPPORTED_VERSIONS


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Operate a tabby pod network: IPAM inspection and repair, pools, demo."""


@cli.command()
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table")
def version(output: str) -> None:
    """Print tabbyctl's version and the CNI versions the plugins speak."""
    info = {"version": __version__, "cniVersions": list(SUPPORTED_VERSIONS),
            "python": sys.version.split()[0]}
    if output == "json":
        click.echo(json.dumps(info))
    else:
        click.echo(f"tabby {__version__} (CNI {', '.join(SUPPORTED_VERSIONS)}; "
                   f"Python {info['python']})")


def main() -> None:
    cli(prog_name="tabbyctl")
