"""``megatron-s2 serve``: an OpenAI-compatible HTTP server over the inference engine.

FastAPI + uvicorn in front of :class:`~megatron_s2.inference.InferenceEngine`: ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions`` (streaming, ``n``, log-probs, ``echo``, token-in /
token-out) and vLLM's ``/inference/v1/generate`` token endpoint that RL clients (the
``verifiers`` training client via ``renderers``) call, with vLLM's request fields, defaults and
error shapes. Module map: ``config`` (ServeConfig), ``backend`` (driver thread, asyncio delivery,
disconnects), ``fields`` / ``sampling`` / ``options`` / ``chat`` (request parsing; ``options``
lists the vLLM fields refused unless neutral), ``prompt_logprobs`` (the prompt's full forward),
``text`` (detokenisation, log-prob records), ``responses`` (choices, usage, event streams),
``completions_api``, ``chat_api``, ``token_api``, ``app`` (routes, errors), ``server`` (sockets,
uvicorn); the command is ``megatron_s2.cli.serve``.
"""

from megatron_s2.serve.config import ServeConfig

__all__ = ["ServeConfig", "ServerThread", "bind_socket", "build_state", "serve_forever"]


def __getattr__(name: str):
    """The server pieces import the engine: loaded on first use, not with the CLI parser."""
    if name in __all__:
        from megatron_s2.serve import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
