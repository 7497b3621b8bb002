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
from fastdecode.agents.cli import launch_command  # noqa: E402
from fastdecode.engine.cli import COMMANDS as ENGINE_COMMANDS  # noqa: E402
from fastdecode.eval.cli import eval_command  # noqa: E402
from fastdecode.lab.cli import bench_command  # noqa: E402
from fastdecode.quant.cli import quantize_command  # noqa: E402
from fastdecode.roofline.cli import probe_command, roofline_command  # noqa: E402
from fastdecode.server.cli import serve  # noqa: E402
from fastdecode.train.cli import train_drafter_command  # noqa: E402

for command in (*ENGINE_COMMANDS, roofline_command, probe_command, quantize_command, eval_command, bench_command, serve,
                launch_command, train_drafter_command):
    main.add_command(command)
