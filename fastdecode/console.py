"""The commands' rich output: tables on stdout that stay whole when piped, and on stderr the progress bars and dim
log lines that are not a command's result."""
from rich.console import Console
from rich.progress import track

err = Console(stderr=True)


def table_console(min_width: int, stderr: bool = False) -> Console:
    """The terminal's console; piped (no terminal width to fit), at least `min_width` columns so rows do not wrap."""
    console = Console(stderr=stderr)
    return console if console.is_terminal else Console(stderr=stderr, width=max(console.width, min_width))


def progress(description: str):
    """A transient bar over the items a loop takes: `for item in progress("loading")(items)`."""
    return lambda items: track(items, description=description, console=err, transient=True)


def log(msg: str):
    err.print(f"[dim]{msg}[/dim]")
