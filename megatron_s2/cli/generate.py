"""``megatron-s2 generate <checkpoint> --prompt TEXT``: talk to a checkpoint from the terminal.

``<checkpoint>`` is a run directory, its ``checkpoints/`` directory, a step directory or a
Hugging Face export (:mod:`megatron_s2.inference.weights`); the tokenizer is the run's
``tokenizer.json`` (next to ``config.json`` for an export). The completion is streamed to
stdout as it is generated; ``--temperature 0`` decodes greedily. Bad input exits with code 2
and one line naming the argument.

``--image FILE`` (repeatable) gives the model images (a checkpoint with a vision tower,
``model.vision_n_layers > 0``): each ``<image>`` in the prompt is where the next file goes, in
order; a prompt without ``<image>`` gets one per file prepended (images first, then the text).
A missing, corrupt or refused file (:func:`megatron_s2.data.images.load_image`: truncated,
decompression bomb, extreme aspect ratio, animated, unsupported format), a count of ``<image>``
that differs from the files, or a model without a vision tower exits with code 2 and one line.

``--memory-decoder RUN`` (Intern-S2 walkthrough Ch. 2): a ``memdec_router`` run's plug-in decodes
in lock-step with the backbone and every token comes from the router's per-token mix (Eq. 3); a
plug-in made for another backbone (vocabulary, tokenizer, width, architecture), a missing path or
a run without the router exits with code 2 and one line.

``--series JSON_OR_FILE`` (a ``phase.kind: timeseries_forecast`` checkpoint; Intern-S2 §2.2.2):
numbers, not text — :mod:`megatron_s2.cli.generate_series`.
"""

from __future__ import annotations

import argparse
import sys

from megatron_s2.cli.flag_errors import (built_from_flags, check_memory_decoder_flags, check_speculative_flags,
                                         memory_decoder_from_flags)
from megatron_s2.config.schema import ConfigError

__all__ = ["register", "generate_command"]


def generate_command(args: argparse.Namespace) -> int:
    from megatron_s2.inference import EngineConfig, EngineDriver, InferenceEngine, PromptTooLong, SamplingParams
    from megatron_s2.inference.detokenizer import IncrementalDetokenizer
    from megatron_s2.inference.weights import load_model

    if args.series is not None:   # --prompt is the instruction there, optional with --horizon
        from megatron_s2.cli.generate_series import forecast_command

        return forecast_command(args)
    for flag, given in (("--horizon", args.horizon is not None), ("--sample-rate", args.sample_rate is not None)):
        if given:   # a forecast's flags: never dropped without a word when text is generated
            raise ConfigError(f"{flag}: only with --series (a forecast); give --series or drop {flag}")
    if not args.prompt:
        raise ConfigError("--prompt: give the text to continue, e.g. --prompt 'Once upon a time'")
    # every option is checked before the (slow) model load, and an error names its flag
    check_speculative_flags(args)
    check_memory_decoder_flags(args)
    images = _load_images(args.image or [])
    params = built_from_flags(SamplingParams, max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    engine_config = built_from_flags(EngineConfig, max_num_seqs=1, max_model_len=args.max_model_len,
                                     prefill_chunk=256, max_prefill_tokens=256, speculative=args.speculative,
                                     speculative_tokens=args.speculative_tokens)
    model, tokenizer, description = load_model(args.checkpoint, args.device)
    plugin = memory_decoder_from_flags(args, model, tokenizer)
    engine = InferenceEngine(model, engine_config, eos_token_ids=[tokenizer.eos_id], detokenize=tokenizer.decode,
                             memory_decoder=plugin)
    if plugin is not None:
        description += f" + memory decoder {plugin.description}"
    prompt = ([tokenizer.bos_id] if args.bos else []) + _prompt_ids(args.prompt, tokenizer, engine, len(images))
    try:
        handle = engine.submit(prompt, params, images=images)
    except PromptTooLong as exc:
        raise ConfigError(f"--prompt: {exc} (raise --max-model-len)") from None
    except ValueError as exc:  # the images do not fit the model's processor
        raise ConfigError(f"--image: {exc}") from None
    print(f"[{description}]", file=sys.stderr)
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    driver, last, generated = EngineDriver(engine), None, 0
    text = IncrementalDetokenizer(tokenizer.decode, context=prompt)  # a partly decoded character waits
    while engine.has_work():
        driver.step()
        while not handle.empty():
            last = handle.get()
            generated += len(last.token_ids)
            sys.stdout.write(text.push(last.token_ids))
        sys.stdout.flush()
    sys.stdout.write(text.flush() + "\n")
    reason = last.finish_reason.value if last is not None and last.finish_reason else "?"
    spec = engine.stats().get("speculative")
    extra = (f", {spec['tokens_per_round']:.2f} tokens per verification, draft acceptance "
             f"{spec['acceptance_rate']:.2f}, {spec['speculative_steps']} of "
             f"{spec['speculative_steps'] + spec['plain_steps']} decode steps drafted" if spec else "")
    print(f"[{generated} tokens, finish reason: {reason}{extra}]", file=sys.stderr)
    return 0


def _load_images(paths: list[str]) -> list:
    """Every ``--image`` decoded (before the model loads, so a bad file costs nothing)."""
    from megatron_s2.data.images import ImageError, load_image

    images = []
    for path in paths:
        try:
            images.append(load_image(path))
        except ImageError as exc:
            raise ConfigError(f"--image: {exc}") from None
    return images


def _prompt_ids(text: str, tokenizer, engine, num_images: int) -> list[int]:
    """The prompt's ids, each ``<image>`` a placeholder (prepended when the text has none)."""
    from megatron_s2.inference.image_prompt import IMAGE_MARKER, encode_with_images

    if not num_images:
        return tokenizer.encode(text)
    if engine.image_token_id is None:
        raise ConfigError("--image: this checkpoint's model has no vision tower (model.vision_n_layers: 0); drop "
                          "--image or use a vision-language checkpoint")
    ids, found = encode_with_images(tokenizer.encode, text, engine.image_token_id)
    if found == 0:
        return [engine.image_token_id] * num_images + ids
    if found != num_images:
        raise ConfigError(f"--prompt: it has {found} {IMAGE_MARKER} placeholder(s) but {num_images} --image file(s) "
                          f"were given; use one {IMAGE_MARKER} per file, or none to put the images first")
    return ids


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text from a checkpoint (streams to the terminal)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="run, checkpoints, step or Hugging Face export directory")
    p.add_argument("--prompt", default=None, help="text to continue (with --series: the instruction; optional with --horizon)")
    p.add_argument("--image", action="append", metavar="FILE",
                   help="an image for a vision-language model (repeatable); each <image> in the prompt is where the "
                        "next one goes, or all go first when the prompt has none")
    p.add_argument("--series", default=None, metavar="JSON_OR_FILE",
                   help="forecast a series instead of generating text: a JSON array ([steps] or [channels][steps]) or "
                        "a local .csv/.parquet/.npz file; --prompt is the instruction (\"predict 12 steps ahead\"); "
                        "prints {\"horizon\", \"forecast\"} (cli/generate_series.py)")
    p.add_argument("--sample-rate", type=float, default=None, metavar="HZ",
                   help="the series' sampling rate, for instructions in time units (default: the file's, if any)")
    p.add_argument("--horizon", type=int, default=None, help="forecast steps (default: read from --prompt)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus probability (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed, -2**63 .. 2**64-1 (default: fixed engine seed)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--max-model-len", type=int, default=2048, help="prompt + generated tokens (default 2048)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    p.add_argument("--speculative", action="store_true",
                   help="speculative decoding with the checkpoint's DSpark drafter (lossless; report §2.4.3)")
    p.add_argument("--speculative-tokens", type=int, default=0,
                   help="drafts verified per step at most (default 0 = the drafter's block size)")
    p.add_argument("--memory-decoder", default=None, metavar="RUN_OR_CHECKPOINT",
                   help="decode with a Memory Decoder plug-in (the phase.kind: memdec_router run trained for this "
                        "backbone): every token is sampled from the router's per-token mix of both models")
    p.add_argument("--no-bos", dest="bos", action="store_false", help="do not start the prompt with <bos>")
    p.set_defaults(func=generate_command)
