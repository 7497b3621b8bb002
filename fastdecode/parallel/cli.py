"""`--tp N` for generate, chat and serve: every rank runs the same command under torchrun; rank 0 goes on to do
what the command does, the others follow its forward passes and exit when it is done. Only rank 0 prints."""
from __future__ import annotations

import atexit
import os
import sys

import click

from fastdecode.errors import FastdecodeError


def build_parallel_llm(tp: int, model: str, **kw):
    """Rank 0: returns its ParallelLLM. Other ranks: never return; they follow rank 0, then exit (0 when rank 0
    closed them, 1 when it died or fell silent, 2 on an error rank 0 reports too, e.g. a model that cannot be
    split)."""
    from fastdecode.parallel.llm import ParallelLLM

    rank = int(os.environ.get("RANK", 0))
    try:
        llm = ParallelLLM(model, tp=tp, on_failure=_exit_lost, **kw)
    except FastdecodeError:
        if rank == 0:
            raise
        sys.exit(2)
    if llm.leads:
        atexit.register(llm.close)  # however rank 0's command ends, its followers are released
        return llm
    try:
        llm.follow()
    except (RuntimeError, KeyboardInterrupt) as e:  # gloo and NCCL report a lost peer or a timeout as RuntimeError
        _exit_lost(e)
    # Rank 0 may already be gone: tearing the group down then races gloo's threads (an abort in C++ at exit, seen
    # about one run in four), and nothing is left to release, so leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_lost(error: BaseException):
    """A rank died or fell silent: say so in one line and end this process now, from whichever thread noticed
    (a server's keep-alive thread too); destroying a broken group can block, and nothing is left to save."""
    rank = os.environ.get("RANK", "?")
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    click.secho(f"error: rank {rank}: the tensor-parallel group failed ({first}); exiting", fg="red", err=True)
    sys.stderr.flush()
    os._exit(1)
