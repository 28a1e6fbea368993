"""Assemble and run a server: engine + backend + app on a pre-bound socket.

The socket is bound before the (slow) model load, so a port in use or a host that is not
this machine's is reported at once, as one line (:func:`bind_socket`). :func:`serve_forever`
runs uvicorn in the foreground (``megatron-s2 serve``); :class:`ServerThread` runs it on a
background thread — the tests, or a trainer that serves its own rollouts in-process.
"""

from __future__ import annotations

import errno
import socket
import threading
import time

from megatron_s2.config.schema import ConfigError
from megatron_s2.config.engine import EngineConfig
from megatron_s2.inference.engine import InferenceEngine
from megatron_s2.serve.backend import AsyncEngine
from megatron_s2.serve.config import ServeConfig
from megatron_s2.serve.state import ServerState

__all__ = ["build_state", "bind_socket", "serve_forever", "ServerThread"]


def build_state(model, tokenizer, description: str, config: ServeConfig, engine_config: EngineConfig,
                model_name: str, memory_decoder=None) -> ServerState:
    """An engine over ``model`` (eval mode, every layer on this rank) behind a backend;
    ``memory_decoder``: a :class:`~megatron_s2.inference.memory_decoder.MemoryDecoder` plug-in."""
    engine = InferenceEngine(model, engine_config, eos_token_ids=[tokenizer.eos_id], detokenize=tokenizer.decode,
                             memory_decoder=memory_decoder)
    state = ServerState(AsyncEngine(engine), tokenizer, config, config.served_model_name or model_name, description)
    state.max_token_bytes  # computed once here, not on the first request's event-loop turn
    return state


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``; ConfigError naming --host / --port otherwise."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"--host: cannot resolve {host!r} ({getattr(exc, 'strerror', None) or exc}); give an "
                          "address of this machine, e.g. 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port: {port} is already in use on {host}; choose another port "
                              "(--port 0 picks a free one)") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"--host: {host} is not an address of this machine; use 127.0.0.1, 0.0.0.0 or "
                              "one of its interfaces") from None
        if exc.errno == errno.EACCES:
            raise ConfigError(f"--port: listening on {port} needs privileges; choose a port >= 1024") from None
        raise ConfigError(f"--host/--port: cannot listen on {host}:{port} ({exc.strerror})") from None
    return sock


def _uvicorn_server(state: ServerState, log_level: str, keep_alive_s: float = 5.0):
    import uvicorn

    from megatron_s2.serve.app import build_app

    config = uvicorn.Config(build_app(state), log_level=log_level, lifespan="off", timeout_graceful_shutdown=2,
                            timeout_keep_alive=keep_alive_s)
    return uvicorn.Server(config)


def serve_forever(state: ServerState, sock: socket.socket, log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM), then stop the engine driver."""
    state.backend.start()
    try:
        _uvicorn_server(state, log_level).run(sockets=[sock])
    finally:
        state.backend.stop()


class ServerThread:
    """A server on a background thread: ``with ServerThread(state) as s: s.url``."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 keep_alive_s: float = 5.0):
        """``keep_alive_s``: how long an idle client connection is kept open. A client that reuses
        a pooled connection the server is closing gets a connection error (clients that never
        retry, as verifiers' TrainClient, fail the episode), so an in-process rollout server whose
        requests may be minutes apart keeps them open longer."""
        self.state = state
        self.sock = bind_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self._server = _uvicorn_server(state, log_level, keep_alive_s)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]},
                                        name="megatron-s2-serve-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "ServerThread":
        self.state.backend.start()
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self.state.backend.stop()
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
