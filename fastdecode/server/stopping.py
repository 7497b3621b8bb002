"""Stopping: a signal (Ctrl-C, SIGTERM) ends every request at once, each with a 503 its client can read.

On a signal uvicorn stops accepting, waits up to its grace period for the open requests, then cancels their tasks:
every request still waiting for the engine or generating was answered 500, with a traceback each in the log (10 queued
requests at Ctrl-C, 10 tracebacks), and a stream was cut without a word. Here the first signal also closes the
scheduler: a request waiting or not yet answered gets 503 `shutting_down`, a stream ends with that error event, the
engine drops their sequences at its next step, and the process exits as soon as the connections have closed.
"""
from __future__ import annotations

import asyncio
from typing import Callable

import uvicorn
from uvicorn.config import STARTUP_FAILURE  # uvicorn.run's exit status when the server could not start


class StoppingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]):
        super().__init__(config)
        self.on_stop = on_stop
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None):
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame):
        # A signal handler, between two bytecodes of the loop's thread: the work goes onto the loop.
        if not self.should_exit and self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_stop)
        super().handle_exit(sig, frame)


def run_server(app, on_stop: Callable[[], None], **config):
    """uvicorn.run(app, **config), with `on_stop` called on the event loop at the first signal."""
    server = StoppingServer(uvicorn.Config(app, **config), on_stop)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the signal it caught again once it has shut down
        pass
    if not server.started:
        raise SystemExit(STARTUP_FAILURE)
