"""Held-out visual question answering of a trained multimodal run, teacher-forced (issue 22).

    python tools/eval_image_qa.py RUN_DIR [--items 300] [--step N]

Loads the run's newest checkpoint (or ``--step``), draws procedural items from the *held-out*
seed (``data.split: heldout``: no training image is ever among them) and asks each its
question ("what shape is this?", "what digit is this?", ...) in the training layout
``bos [image span] question sep answer eos``. With the answer teacher-forced, an item counts as
correct when the model's argmax predicts every answer character and the closing eos. Chance is
the mean over items of 1 / (number of possible answers to its question) — an upper bound on a
guesser that knows the question but not the image (it would also have to spell the answer).
Prints accuracy and chance overall and per question. ``--blank-images`` asks the same questions
about uniform grey images of the same size: the ablation that shows whether answers use the pixels.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

__all__ = ["score_heldout", "main"]

ANSWERS_PER_QUESTION = {"what shape is this?": 5, "what colour is the shape?": 7, "what digit is this?": 10,
                        "what colour is the digit?": 7, "what does the text say?": 12}
"""Possible answers per question of the procedural source (SHAPES, COLOURS, digits, WORDS)."""


def score_heldout(run_dir: str | Path, items: int = 300, step: int | None = None, blank_images: bool = False) -> dict:
    """{"accuracy", "chance", "items", "per_question": {q: (correct, total, chance)}} of a run."""
    import torch

    from megatron_s2.config.recipe import load_recipe
    from megatron_s2.data.image_text import build_image_text_documents
    from megatron_s2.inference.weights import load_model
    from megatron_s2.models.family import family_of

    from megatron_s2.config.schema import ConfigError

    if items < 1:
        raise ConfigError(f"--items: must be >= 1, got {items}")
    run_dir = Path(run_dir)
    recipe = load_recipe(run_dir / "config.yaml")
    # the questions, their answers and the held-out split exist only for the procedural source
    if recipe.data.kind != "image_text" or recipe.data.source != "procedural":
        field = "kind" if recipe.data.kind != "image_text" else "source"
        raise ConfigError(f"data: the run trained on data.{field} {getattr(recipe.data, field)!r}; eval_image_qa "
                          "scores runs on the procedural image_text source (recipes/pretrain_mm_tiny.yaml)")
    checkpoints = run_dir / "checkpoints"
    path = checkpoints / f"step_{step:08d}" if step is not None else checkpoints
    model, tokenizer, _ = load_model(str(path), device="cpu")
    processor = family_of(model.config).image_processor(model.config)
    data = dataclasses.replace(recipe.data, split="heldout", image_text_format="qa", num_documents=items)
    store = build_image_text_documents(data, seed=recipe.training.seed, tokenizer=tokenizer, processor=processor,
                                       seq_length=recipe.training.seq_length)
    per_question: dict[str, list[int]] = {}
    with torch.no_grad():
        for doc in range(len(store)):
            pair = store.pairs[doc]
            tokens = torch.from_numpy(store.tokens(doc).copy()).unsqueeze(0)
            (span,) = store.images_of(doc)
            picture = store.load_image(span.pair)
            if blank_images:  # the ablation: same size and span, no content
                picture = picture.point(lambda _: 127)
            image = processor.prepare(picture, span.offset)
            mask = torch.zeros_like(tokens, dtype=torch.bool)
            mask[0, span.offset:span.offset + span.length] = True
            ctx = model.make_context({"tokens": tokens, "image_mask": mask})
            logits = model(tokens, ctx, images=[[image]])
            predicted = logits[0].argmax(-1)  # a single rank holds the whole vocabulary
            answer = len(tokenizer.encode(pair.text)) + 1  # the answer's characters and eos
            first = tokens.size(1) - answer  # positions whose next token is an answer token
            right = bool(torch.equal(predicted[first - 1:-1], tokens[0, first:]))
            counts = per_question.setdefault(pair.prompt, [0, 0])
            counts[0] += right
            counts[1] += 1
    total = sum(c[1] for c in per_question.values())
    correct = sum(c[0] for c in per_question.values())
    chance = sum(c[1] / ANSWERS_PER_QUESTION[q] for q, c in per_question.items()) / total
    return {"accuracy": correct / total, "chance": chance, "items": total,
            "per_question": {q: (c[0], c[1], 1 / ANSWERS_PER_QUESTION[q]) for q, c in sorted(per_question.items())}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--items", type=int, default=300, help="held-out items to ask (default 300)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--blank-images", action="store_true", help="ablation: uniform grey images instead")
    args = parser.parse_args(argv)
    from megatron_s2.checkpoint.format import CheckpointError
    from megatron_s2.config.schema import ConfigError
    from megatron_s2.data.errors import DataError

    try:
        result = score_heldout(args.run_dir, args.items, args.step, args.blank_images)
    except (ConfigError, DataError, CheckpointError) as exc:  # a user's mistake: one line, no traceback
        print(f"eval_image_qa: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"held-out answer accuracy {result['accuracy']:.3f} vs chance {result['chance']:.3f} "
          f"({result['items']} items, teacher-forced)")
    for question, (correct, total, chance) in result["per_question"].items():
        print(f"  {question:<28} {correct:>4}/{total:<4} = {correct / total:.3f}  (chance {chance:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
