"""`python -m fastdecode.server -m MODEL ...`: the same as `fastdecode serve`."""
import sys

import click

from fastdecode.errors import FastdecodeError
from fastdecode.server.cli import serve

if __name__ == "__main__":
    try:
        serve.main(standalone_mode=False)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except FastdecodeError as e:
        click.secho(f"error: {e}", fg="red", err=True)
        sys.exit(2)
