"""Running the app with uvicorn: in the foreground (``draftwise serve``) or in a background thread on a
free loopback port (tests, ``draftwise bench-serve``).

Shutdown (``DrainingServer``): the first SIGTERM or SIGINT drains: new generation requests are answered
503 with ``Retry-After`` (and /health 503 ``draining``) while the requests already admitted run to their
end; once none is left, or ``shutdown_timeout`` seconds have passed (the engine then fails what is still
running: a 500, or an error event in a stream), uvicorn closes the connections and the process exits 0.
A second signal exits at once (status 1), dropping whatever was running.
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import sys
import threading
import time

import uvicorn

from ..errors import DraftwiseError
from .app import create_app
from .engine import Engine


def say(message: str) -> None:
    print(f"draftwise: {message}", file=sys.stderr, flush=True)

SHUTDOWN_TIMEOUT_S = 30.0  # default --shutdown-timeout
CLOSE_TIMEOUT_S = 5.0  # after draining: how long uvicorn waits for responses to finish sending
EXIT_FORCED = 1  # the exit status after a second signal


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a draining shutdown (see the module docstring). ``drain()`` starts it from
    any thread (the signal handler calls it)."""

    def __init__(self, config: uvicorn.Config, engine: Engine, shutdown_timeout: float = SHUTDOWN_TIMEOUT_S):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.draining_since: float | None = None

    def drain(self) -> None:
        if self.draining_since is None:
            self.draining_since = time.monotonic()
            self.engine.drain()
            say(f"draining: new requests get 503; {self.engine.snapshot()['requests']} admitted request(s) "
                f"may run for up to {self.shutdown_timeout:g} s (--shutdown-timeout); a second signal exits at once")

    def handle_exit(self, sig: int, frame) -> None:
        # not uvicorn's: it stops at once and re-raises the signal after shutdown (exit status 143)
        if self.draining_since is None:
            self.drain()
            return
        say(f"second signal: exiting now, {self.engine.snapshot()['requests']} request(s) dropped")
        os._exit(EXIT_FORCED)

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.draining_since is None:
            return False
        if self.engine.idle:
            say("drained: every admitted request finished; exiting")
            return True
        if time.monotonic() - self.draining_since >= self.shutdown_timeout:
            say(f"--shutdown-timeout ({self.shutdown_timeout:g} s) passed with "
                f"{self.engine.snapshot()['requests']} request(s) unfinished; failing them")
            await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)
            return True
        return False


def listen_socket(host: str, port: int):
    """A socket bound to ``host:port`` (the address family from the host: IPv4, IPv6 or a name), for uvicorn
    to listen on. Errors (the port in use, an address this machine does not have, a privileged port, an
    unknown host name) are a DraftwiseError naming the address."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise DraftwiseError(f"cannot serve on {host}:{port}: unknown host ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses the port
        sock.bind(addr)
    except OSError as e:
        sock.close()
        hint = " (another server? choose another --port)" if e.errno == errno.EADDRINUSE else ""
        raise DraftwiseError(f"cannot serve on {host}:{port}: {e.strerror or e}{hint}") from None
    return sock


def run_server(engine: Engine, model_name: str, sock: socket.socket, api_key: str | None = None,
               log_level: str = "info", shutdown_timeout: float = SHUTDOWN_TIMEOUT_S) -> int:
    """Serve on ``sock`` (bound, not yet listening: ``listen_socket``) until a signal (SIGTERM /
    Ctrl-C drain, then exit). Returns the exit status: 0."""
    app = create_app(engine, model_name, api_key)
    host, port = sock.getsockname()[:2]  # the config's address: uvicorn serves the socket itself
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=CLOSE_TIMEOUT_S)
    server = DrainingServer(config, engine, shutdown_timeout)
    server.run(sockets=[sock])
    if not server.started:  # uvicorn logged why
        raise OSError(f"uvicorn did not start on {sock.getsockname()}")
    return 0


class BackgroundServer:
    """The app served by uvicorn in a daemon thread on 127.0.0.1 and a free port::

        with BackgroundServer(engine, "smollm2-135m-instruct") as srv:
            OpenAI(base_url=srv.base_url + "/v1", api_key="-")
    """

    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None, host: str = "127.0.0.1"):
        self.engine = engine
        self.app = create_app(engine, model_name, api_key)
        self.sock = listen_socket(host, 0)  # the kernel picks a free port; uvicorn serves this very socket
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
        self.server = DrainingServer(config, engine)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="draftwise-http", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
