"""Held-out visual question answering of a trained multimodal run through ``megatron-s2 serve`` (issue 22).

    python tools/serve_image_qa.py RUN_DIR [--items 100] [--base-url http://127.0.0.1:8000/v1]
                                   [--blank-images] [--json] [--smoke]

The end-to-end form of ``tools/eval_image_qa.py``: the same held-out procedural items
(``data.split: heldout`` of the run's own data section, never trained on), each sent with the real
``openai`` client as one user message ``[image_url part (data:image/png;base64), text part
(the question)]`` to ``/v1/chat/completions``, greedy (temperature 0), and the reply compared with
the true answer ("circle", "7", "red", ...). Nothing is teacher-forced: the server's chat template
renders the message, the engine expands the image placeholder into the tower's span and decodes.
Without ``--base-url`` the script starts ``megatron-s2 serve RUN_DIR --port 0`` itself (a
subprocess, the command a user runs) and stops it at the end. Prints accuracy against chance
(mean over items of 1 / answers to its question) overall and per question; ``--blank-images``
sends uniform grey images of the same size instead — the ablation whose gap to the real images
shows that answers come from the pixels. ``--smoke``: 4 items, a check that the path works.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["heldout_questions", "ask_served", "serve_run", "main"]


def heldout_questions(run_dir: str | Path, items: int) -> list[tuple[object, str, str]]:
    """(RGB image, question, answer) of the run's first ``items`` held-out procedural items."""
    from megatron_s2.config.recipe import load_recipe
    from megatron_s2.config.schema import ConfigError
    from megatron_s2.data.image_text import load_image_text_pairs

    if items < 1:
        raise ConfigError(f"--items: must be >= 1, got {items}")
    recipe = load_recipe(Path(run_dir) / "config.yaml")
    if recipe.data.kind != "image_text" or recipe.data.source != "procedural":
        field = "kind" if recipe.data.kind != "image_text" else "source"
        raise ConfigError(f"data: the run trained on data.{field} {getattr(recipe.data, field)!r}; serve_image_qa "
                          "asks about the procedural image_text source (recipes/sft_image_qa_tiny.yaml)")
    data = dataclasses.replace(recipe.data, split="heldout", image_text_format="qa", num_documents=items)
    return [(pair.load(), pair.prompt, pair.text) for pair in load_image_text_pairs(data, recipe.training.seed)]


def _data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def ask_served(base_url: str, questions, model: str | None = None, blank_images: bool = False) -> dict:
    """{"accuracy", "chance", "items", "per_question", "examples"} of ``questions`` asked through
    the server at ``base_url`` (ending in /v1), greedy, one request per item."""
    import openai

    from megatron_s2.tools.eval_image_qa import ANSWERS_PER_QUESTION

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    model = model or client.models.list().data[0].id
    per_question: dict[str, list[int]] = {}
    examples = []
    for image, question, answer in questions:
        if blank_images:  # the ablation: same size, no content
            image = image.point(lambda _: 127)
        reply = client.chat.completions.create(
            model=model, temperature=0, max_tokens=12, extra_body={"return_token_ids": True},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(image)}},
                                                   {"type": "text", "text": question}]}])
        said = (reply.choices[0].message.content or "").strip()
        counts = per_question.setdefault(question, [0, 0])
        counts[0] += said == answer
        counts[1] += 1
        if len(examples) < 8:  # with the ids the engine ran: the layout check of the smoke test
            examples.append({"question": question, "answer": answer, "reply": said,
                             "prompt_token_ids": getattr(reply, "prompt_token_ids", None)})
    total = sum(c[1] for c in per_question.values())
    correct = sum(c[0] for c in per_question.values())
    chance = sum(c[1] / ANSWERS_PER_QUESTION[q] for q, c in per_question.items()) / total
    return {"accuracy": correct / total, "chance": chance, "items": total, "examples": examples,
            "per_question": {q: (c[0], c[1], 1 / ANSWERS_PER_QUESTION[q]) for q, c in sorted(per_question.items())}}


class serve_run:
    """``with serve_run(RUN_DIR) as base_url:`` — ``megatron-s2 serve RUN_DIR --port 0`` as a
    subprocess, its base URL read from the line it prints when listening."""

    def __init__(self, run_dir: str | Path, timeout_s: float = 300.0):
        self.run_dir, self.timeout_s, self.process = str(run_dir), timeout_s, None

    def __enter__(self) -> str:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.process = subprocess.Popen([sys.executable, "-m", "megatron_s2.cli", "serve", self.run_dir, "--port", "0",
                                         "--log-level", "warning"], stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + self.timeout_s
        lines = []
        for line in self.process.stderr:  # the server prints its address once the model is loaded
            lines.append(line)
            found = re.search(r"listening on (http://\S+)", line)
            if found:
                return found.group(1) + "/v1"
            if time.monotonic() > deadline:
                break
        self.__exit__()
        raise RuntimeError("megatron-s2 serve did not start:\n" + "".join(lines[-20:]))

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="the training run (its config.yaml names the data; served unless --base-url)")
    parser.add_argument("--items", type=int, default=100, help="held-out items to ask (default 100)")
    parser.add_argument("--base-url", default=None, help="an already running server, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="model id to send (default: the server's first)")
    parser.add_argument("--blank-images", action="store_true", help="ablation: uniform grey images instead")
    parser.add_argument("--smoke", action="store_true", help="4 items: check the path end to end")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    from megatron_s2.config.schema import ConfigError
    from megatron_s2.data.errors import DataError

    import openai

    try:
        questions = heldout_questions(args.run_dir, 4 if args.smoke else args.items)
        if args.base_url:
            result = ask_served(args.base_url, questions, args.model, args.blank_images)
        else:
            with serve_run(args.run_dir) as base_url:
                result = ask_served(base_url, questions, args.model, args.blank_images)
    except (ConfigError, DataError) as exc:  # a user's mistake: one line, no traceback
        print(f"serve_image_qa: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    except openai.APIConnectionError:  # nothing answers there: the flag is wrong (or the server is down)
        print(f"serve_image_qa: error: --base-url: no server answers at {args.base_url}; start `megatron-s2 serve "
              f"RUN_DIR` or give its address ending in /v1", file=sys.stderr)
        return 2
    except openai.APIStatusError as exc:  # the server refused a request: its reason, on one line
        body = exc.body.get("error", exc.body) if isinstance(exc.body, dict) else None  # openai keeps "error"'s value
        reason = " ".join(str(body.get("message", body)).split()) if isinstance(body, dict) else \
            "not an OpenAI-compatible reply (is --base-url the server's /v1 address?)"
        print(f"serve_image_qa: error: the server answered {exc.status_code}: {reason}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"served held-out answer accuracy {result['accuracy']:.3f} vs chance {result['chance']:.3f} "
          f"({result['items']} items, greedy{', blank images' if args.blank_images else ''})")
    for question, (correct, total, chance) in result["per_question"].items():
        print(f"  {question:<28} {correct:>4}/{total:<4} = {correct / total:.3f}  (chance {chance:.3f})")
    for example in result["examples"][:4]:
        print(f"  e.g. {example['question']!r} -> {example['reply']!r} (answer {example['answer']!r})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
