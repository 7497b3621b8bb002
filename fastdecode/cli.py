"""`fastdecode` command line. Each part of the package contributes its commands; errors a user can fix print one
line and exit with code 2."""
import sys

import click

from fastdecode.errors import FastdecodeError


class Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except FastdecodeError as e:
            click.secho(f"error: {e}", fg="red", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


@click.group(cls=Group)
@click.version_option(package_name="fastdecode")
def main():
    """fastdecode: fast LLM decoding, measured."""


# ---- commands from each part (imports kept here so `fastdecode --help` lists them all) ----
from fastdecode.engine.cli import COMMANDS as ENGINE_COMMANDS  # noqa: E402

for command in ENGINE_COMMANDS:
    main.add_command(command)

from fastdecode.roofline.cli import probe_command, roofline_command  # noqa: E402

main.add_command(roofline_command)
main.add_command(probe_command)
