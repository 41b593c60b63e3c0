"""Running the app with uvicorn: in the foreground (``draftwise serve``) or in a background thread on a
free loopback port (tests, ``draftwise bench-serve``)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from .app import create_app
from .engine import Engine


def run_server(engine: Engine, model_name: str, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM stop uvicorn, whose shutdown stops the engine)."""
    app = create_app(engine, model_name, api_key)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug",
                timeout_graceful_shutdown=5)


class BackgroundServer:
    """The app served by uvicorn in a daemon thread on 127.0.0.1 and a free port::

        with BackgroundServer(engine, "smollm2-135m-instruct") as srv:
            OpenAI(base_url=srv.base_url + "/v1", api_key="-")
    """

    def __init__(self, engine: Engine, model_name: str, api_key: str | None = None, host: str = "127.0.0.1"):
        self.engine = engine
        self.app = create_app(engine, model_name, api_key)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))  # the kernel picks a free port; uvicorn serves this very socket
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
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
