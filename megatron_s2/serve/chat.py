"""Chat messages -> prompt token ids with the tokenizer's own chat template.

The template is the tokenizer's (``tokenizer.apply_chat_template``, e.g. the V4-style template
of a Hugging Face tokenizer directory); the server never invents one. A tokenizer without a
chat template answers 400 "this model has no chat template" — use ``/v1/completions`` (text
or token ids) or render client-side and call ``/inference/v1/generate``.

Messages are checked before rendering: ``role`` in system / user / assistant / tool, text
``content`` (a string or a list of ``{"type": "text"}`` parts), and the assistant fields the
template reads (``reasoning_content``, ``tool_calls``) passed through. ``chat_template_kwargs``
may carry ``reasoning_effort`` (report §5.1.4: an integer 1..100). vLLM's rendering fields:
``add_generation_prompt`` (default true), ``continue_final_message`` (the prompt ends inside the
last message, so the model continues it: the rendered text is cut after that message's content,
as transformers does), ``add_special_tokens`` (default false for chat: ``<bos>`` on top of what
the template writes).

**Images.** A user message's content may hold ``{"type": "image_url", "image_url": {"url": ...}}``
parts (:mod:`megatron_s2.serve.media` reads the URL). Each part is rendered as the marker
``<image>`` (:data:`~megatron_s2.inference.image_prompt.IMAGE_MARKER`) where it stands among the
text parts, so the template places it; after rendering, each marker becomes the model's image
placeholder id and the engine expands it into the image's span. A request whose text itself
contains ``<image>`` next to image parts is refused (the places would be ambiguous).

**Series.** A user message may hold ``{"type": "time_series", "time_series": {"values": [[...]],
"sample_rate": 4}}`` parts (or ``{"path": ...}`` under ``--allowed-local-media-path``), rendered as
``<series>`` the same way and expanded by the engine into the series' span
(:mod:`megatron_s2.serve.series`; Intern-S2 §2.2.1-§2.2.2).
"""

from __future__ import annotations

from typing import Callable

from megatron_s2.data.hf_tokenizer import HFTokenizer
from megatron_s2.inference.image_prompt import IMAGE_MARKER, encode_with_images, replace_marker_ids
from megatron_s2.serve.errors import BadRequest
from megatron_s2.serve.fields import Fields, shown, shown_text
from megatron_s2.serve.media import ServedImages
from megatron_s2.serve.series import SERIES_MARKER, encode_with_marker

__all__ = ["has_chat_template", "chat_prompt_ids"]

ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_KWARGS = ("reasoning_effort",)


def has_chat_template(tokenizer) -> bool:
    return callable(getattr(tokenizer, "apply_chat_template", None)) and bool(getattr(tokenizer, "has_chat_template",
                                                                                      True))


def _content(content, where: str, role: str, images: ServedImages | None, urls: list, series=None,
             series_specs: list | None = None) -> str:
    """The content's text, each image part an :data:`IMAGE_MARKER` (its URL appended to ``urls``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            at = f"{where}[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind == "image_url" and images is not None:
                images.refuse_unless_supported(at)
                if role != "user":
                    raise BadRequest(f"{at}: image parts are accepted in user messages only, not {role}", param=at)
                url = part.get("image_url")
                urls.append((url.get("url") if isinstance(url, dict) else url, f"{at}.image_url.url"))
                parts.append(IMAGE_MARKER)
            elif kind == "time_series" and series is not None:
                series.refuse_unless_supported(at)
                if role != "user":
                    raise BadRequest(f"{at}: time_series parts are accepted in user messages only, not {role}",
                                     param=at)
                series_specs.append((part.get("time_series"), f"{at}.time_series"))
                parts.append(SERIES_MARKER)
            else:
                raise BadRequest(f"{at}: only text parts ({{\"type\": \"text\", \"text\": ...}}) and image parts "
                                 f"({{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}) are supported (and "
                                 f"time_series parts for a model with a time-series lane)",
                                 param=at)
        return "".join(parts)
    raise BadRequest(f"{where}: must be a string or a list of text and image parts", param=where)


def _messages(value, images: ServedImages | None = None, urls: list | None = None, series=None,
              series_specs: list | None = None) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages: must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"{where}: must be an object with role and content", param=where)
        role = message.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role: must be one of {', '.join(ROLES)}, got {shown(role)}",
                             param=f"{where}.role")
        clean = {"role": role}
        content = message.get("content")
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise BadRequest(f"{where}.content: required", param=f"{where}.content")
        clean["content"] = (_content(content, f"{where}.content", role, images, urls if urls is not None else [],
                                     series, series_specs if series_specs is not None else [])
                            if content is not None else None)
        for key in ("reasoning_content", "tool_calls", "tool_call_id", "name"):
            if message.get(key) is not None:
                clean[key] = message[key]
        out.append(clean)
    return out


def chat_prompt_ids(tokenizer, f: Fields, refuse_overlong: Callable[[list[str], str], None],
                    images: ServedImages | None = None, series=None, series_spans: list | None = None
                    ) -> tuple[list[int], list]:
    """Token ids of the request's conversation, and its images' spans (module docstring; the ids
    hold each image's whole span, as the engine runs them). ``series`` (a
    :class:`~megatron_s2.serve.series.ServedSeries`): time_series parts are read, and their spans
    appended to ``series_spans``.

    The conversation is rendered to text first and ``refuse_overlong`` sees that text before it is
    tokenised: whatever field holds the bulk (``content``, ``reasoning_content``, tool-call
    ``arguments``), a chat that cannot fit the context is refused without tokenising megabytes;
    images are decoded last, once everything else passed."""
    if not has_chat_template(tokenizer):
        raise BadRequest(f"messages: this model has no chat template (its tokenizer {type(tokenizer).__name__} "
                         "defines none); use /v1/completions with a text or token-id prompt", param="messages")
    urls: list[tuple[object, str]] = []
    specs: list[tuple[object, str]] = []
    messages = _messages(f.raw("messages"), images, urls, series, specs)
    if urls:
        images.refuse_too_many(len(urls), "messages")
    if specs:
        series.refuse_too_many(len(specs), "messages")
    kwargs = f.object("chat_template_kwargs")
    kwargs.only(set(TEMPLATE_KWARGS))
    effort = kwargs.int("reasoning_effort", None, minimum=1, maximum=100)
    continue_final = f.bool("continue_final_message")
    options = {"add_generation_prompt": f.bool("add_generation_prompt", True)}
    if continue_final and options["add_generation_prompt"]:
        f.fail("continue_final_message", "cannot be combined with add_generation_prompt (true by default); set "
                                         "add_generation_prompt: false")
    if effort is not None:
        options["reasoning_effort"] = effort
    text = _render(tokenizer, messages, options, tokenize=False)  # Jinja only: cheap, whatever the size
    refuse_overlong([text], "messages")

    def encode_text(rendered: str) -> list[int]:
        """Ids of text without image markers; each series marker becomes the series placeholder."""
        if not specs:
            return tokenizer.encode(rendered)
        return encode_with_marker(tokenizer.encode, rendered, SERIES_MARKER, series.token_id)[0]

    def encode(rendered: str) -> list[int]:
        """The rendered text's ids; each marker the template placed becomes the image placeholder."""
        if specs:
            _check_series_places(rendered.count(SERIES_MARKER), len(specs))
        if not urls:
            return encode_text(rendered)
        ids, found = encode_with_images(encode_text, rendered, images.token_id)
        _check_placeholders(found, len(urls))
        return ids

    if continue_final:
        ids = encode(_cut_after_final_message(tokenizer, text, messages))
    elif _renders_text(tokenizer):  # the template's text is what gets tokenised
        ids = encode(text)
    else:
        ids = [int(t) for t in _render(tokenizer, messages, options, tokenize=True)]
        if urls:
            ids, found = replace_marker_ids(ids, tokenizer.encode(IMAGE_MARKER), images.token_id)
            _check_placeholders(found, len(urls))
        if specs:
            ids, found = replace_marker_ids(ids, tokenizer.encode(SERIES_MARKER), series.token_id)
            _check_series_places(found, len(specs))
    bos = getattr(tokenizer, "bos_id", None)
    ids = ([bos] if f.bool("add_special_tokens") and bos is not None else []) + ids
    if specs:  # series first: their placeholder ids differ from the image placeholder's
        ids, spans = series.prepare(ids, [series.read(spec, param) for spec, param in specs], "messages")
        series_spans.extend(spans)
    if not urls:
        return ids, []
    decoded = [images.load(url, param) for url, param in urls]
    return images.prepare(ids, decoded, "messages")


def _check_series_places(found: int, expected: int) -> None:
    if found != expected:
        raise BadRequest(f"messages: the rendered chat holds {found} series places for {expected} time_series parts; "
                         f"the text must not contain {SERIES_MARKER}, which marks time_series parts", param="messages")


def _check_placeholders(found: int, expected: int) -> None:
    if found != expected:
        raise BadRequest(f"messages: the rendered chat holds {found} image places for {expected} image parts; the "
                         f"text must not contain {IMAGE_MARKER}, which marks image parts", param="messages")


def _cut_after_final_message(tokenizer, text: str, messages: list[dict]) -> str:
    """The rendered conversation up to the end of the last message's content (what the model
    continues), as transformers' ``continue_final_message`` cuts it."""
    if not _renders_text(tokenizer):
        raise BadRequest(f"continue_final_message: this model's tokenizer ({type(tokenizer).__name__}) renders "
                         "chats to token ids, not text that can be cut; render client-side and send token ids",
                         param="continue_final_message")
    final = messages[-1].get("content") or ""
    at = text.rfind(final) if final else -1
    if at < 0:
        raise BadRequest("continue_final_message: the last message's content does not appear in the rendered "
                         "chat (an empty message, or a template that rewrites it)", param="continue_final_message")
    return text[:at + len(final)]


def _renders_text(tokenizer) -> bool:
    """Whether the rendered chat text encodes back to the template's ids (a Hugging Face
    template renders text; the character tokenizer renders ids and only spells them)."""
    return isinstance(tokenizer, HFTokenizer)


def _render(tokenizer, messages: list[dict], options: dict, *, tokenize: bool):
    try:
        return tokenizer.apply_chat_template(messages, tokenize=tokenize, **options)
    except Exception as exc:  # the template's own refusal (unknown role, bad tool call, ...)
        raise BadRequest(f"messages: the chat template cannot render them ({shown_text(str(exc), 200)})",
                         param="messages") from None
