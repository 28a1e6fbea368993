"""``megatron-s2 serve <checkpoint> [--host H] [--port P]``: an OpenAI-compatible server.

``<checkpoint>`` is a run directory, its ``checkpoints/`` directory, a step directory or a
Hugging Face export — the same resolution and tokenizer as ``megatron-s2 generate``
(:func:`megatron_s2.inference.weights.load_model`). The served model id defaults to the path as
given. Bad input (a missing checkpoint, a port in use, a host that is not this machine's, an
out-of-range option) exits with code 2 and one line naming the option, before the model loads
where it can. ``--memory-decoder RUN`` serves the backbone with a Memory Decoder plug-in (as
``megatron-s2 generate``): sampled tokens, their log-probs and ``prompt_logprobs`` are the fused ones.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_s2.cli.flag_errors import (built_from_flags, check_memory_decoder_flags, check_speculative_flags,
                                         memory_decoder_from_flags)
from megatron_s2.config.schema import ConfigError
from megatron_s2.config.engine import LOGPROBS_MODES

__all__ = ["register", "serve_command"]


def _engine_config(args: argparse.Namespace):
    from megatron_s2.config.engine import EngineConfig

    check_speculative_flags(args)
    check_memory_decoder_flags(args)
    return built_from_flags(EngineConfig, max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting,
                            max_model_len=args.max_model_len, prefix_caching=args.prefix_caching, seed=args.seed,
                            speculative=args.speculative, speculative_tokens=args.speculative_tokens)


def serve_command(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ModuleNotFoundError as exc:
        raise ConfigError(f"serve: the server needs {exc.name}; pip install -e '.[serve]'") from None
    from megatron_s2.inference.weights import load_model
    from megatron_s2.serve.config import ServeConfig
    from megatron_s2.serve.server import bind_socket, build_state, serve_forever

    config = ServeConfig(host=args.host, port=args.port, served_model_name=args.served_model_name or "",
                         return_routed_experts=args.enable_return_routed_experts, logprobs_mode=args.logprobs_mode,
                         max_logprobs=args.max_logprobs,
                         allowed_local_media_path=args.allowed_local_media_path or "",
                         max_images_per_request=args.max_images_per_request,
                         gateway_traces=args.gateway_traces or "")
    engine_config = _engine_config(args)
    if not Path(args.checkpoint).exists():
        raise ConfigError(f"checkpoint: {args.checkpoint} does not exist; give a run, checkpoints, step or Hugging "
                          "Face directory")
    if config.gateway_traces:
        _check_trace_dir(config.gateway_traces)
    sock = bind_socket(config.host, config.port)
    try:
        model, tokenizer, description = load_model(args.checkpoint, args.device)
        plugin = memory_decoder_from_flags(args, model, tokenizer)
        if plugin is not None:
            description += f" + memory decoder {plugin.description}"
        state = build_state(model, tokenizer, description, config, engine_config, model_name=args.checkpoint,
                            memory_decoder=plugin)
        host, port = sock.getsockname()[:2]
        # Listen before saying so: uvicorn calls listen() only once its loop has started, and a client
        # that connects on the line below would be refused in between; queued in the backlog, it is
        # answered as soon as uvicorn accepts (a slow start under load made that window seconds long).
        sock.listen(2048)
        print(f"megatron-s2 serve: {description}", file=sys.stderr)
        print(f"megatron-s2 serve: listening on http://{config.host}:{port} (model '{state.model_name}', "
              f"max_model_len {engine_config.max_model_len})", file=sys.stderr, flush=True)
        serve_forever(state, sock, args.log_level)
    finally:
        sock.close()
    return 0


def _check_trace_dir(path: str) -> None:
    """Create the trace store's directory and write in it once now: a store that cannot be written
    is a configuration error at start, not a 500 on every session call later."""
    import tempfile

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(f"--gateway-traces: cannot write the trace store in {path} ({exc.strerror or exc}); give a "
                          "writable directory (created if missing)") from None


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server for a checkpoint",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="run, checkpoints, step or Hugging Face export directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 = all)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = a free port)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the checkpoint path)")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + generated tokens (default 2048)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="requests decoded concurrently (default 16)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="queued requests beyond the running ones; more are answered 429 (default 256)")
    p.add_argument("--prefix-caching", action="store_true", help="keep finished prompts' global KV (LRU)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="return the MoE routing of every token on /inference/v1/generate (routing replay)")
    p.add_argument("--logprobs-mode", default="raw_logprobs", choices=list(LOGPROBS_MODES),
                   help="what log-probs of sampled tokens are, as vLLM's flag: raw_logprobs (default: the model's, "
                        "before temperature / top-k / top-p), processed_logprobs (the distribution sampled from), "
                        "raw_logits, processed_logits")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most log-probs per position a request may ask for, as vLLM's flag (default 20; -1 = the "
                        "whole vocabulary: prompt_logprobs -1 returns a served OPD teacher's full distribution)")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="let chat image_url parts read file:// images under DIR, as vLLM's flag (default: none; "
                        "only inline data: URLs, remote http(s) URLs are always refused)")
    p.add_argument("--max-images-per-request", type=int, default=8, metavar="N",
                   help="most chat image parts one request may hold, refused before decoding (default 8)")
    p.add_argument("--gateway-traces", default=None, metavar="DIR",
                   help="agent gateway: capture every call on /sessions/<id>/v1/... (chat, responses, messages) "
                        "as token-in/token-out PrefixTree traces under DIR, for RL (default: off)")
    p.add_argument("--speculative", action="store_true",
                   help="speculative decoding with the checkpoint's DSpark drafter (lossless; report §2.4.3)")
    p.add_argument("--speculative-tokens", type=int, default=0,
                   help="drafts verified per request and step at most (default 0 = the drafter's block size)")
    p.add_argument("--memory-decoder", default=None, metavar="RUN_OR_CHECKPOINT",
                   help="serve with a Memory Decoder plug-in (the phase.kind: memdec_router run trained for this "
                        "backbone): tokens, log-probs and prompt_logprobs are those of the router's per-token mix")
    p.add_argument("--seed", type=int, default=0, help="seed of requests that bring none (default 0)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level (default info)")
    p.set_defaults(func=serve_command)
