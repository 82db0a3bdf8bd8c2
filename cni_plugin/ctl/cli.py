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
    info = {
        "version": __version__,
        "cniVersions": list(SUPPORTED_VERSIONS),
        "python": sys.version.split()[0],
    }
    if output == "json":
        click.echo(json.dumps(info))
    else:
        click.echo(
            f"tabby {__version__} (CNI {', '.join(SUPPORTED_VERSIONS)}; Python {info['python']})"
        )


@cli.command()
@click.option(
    "--pods",
    type=click.IntRange(1, 50),
    default=3,
    show_default=True,
    help="how many pods to create",
)
@click.option("--keep", is_flag=True, help="leave the namespaces and store in place")
@click.option(
    "--cni-bin-dir",
    default="/opt/cni/bin",
    show_default=True,
    help="where the installed plugins are",
)
def demo(pods: int, keep: bool, cni_bin_dir: str) -> None:
    """Build a node and N pods in throwaway namespaces, network them, prove it, clean up."""
    from cni_plugin.ctl import demo as demo_mod

    try:
        rc = demo_mod.run(pods, keep, cni_bin_dir, click.echo)
    except demo_mod.DemoError as e:
        raise click.ClickException(str(e)) from None
    sys.exit(rc)


def main() -> None:
    cli(prog_name="tabbyctl")
