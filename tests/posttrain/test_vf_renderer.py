"""The turn-bridging renderer (megatron_s2/posttrain/envs/vf_renderer.py) on the shipped BPE
tokenizer's chat template: the next prompt keeps the previous prompt and sampled ids verbatim,
adds the template's close (eos) only to a reply that lacks it, and then equals what the template
renders for the whole conversation when the reply re-tokenises the same way."""

from __future__ import annotations

from pathlib import Path

from renderers import CustomRendererConfig, create_renderer
from renderers.base import load_tokenizer

from megatron_s2.posttrain.envs.vf_renderer import IMPORT_PATH

TOKENIZER = Path(__file__).resolve().parents[2] / "recipes" / "tokenizers" / "tiny-bpe"


def test_bridge_extends_the_sampled_ids_verbatim():
    tok = load_tokenizer(str(TOKENIZER))
    r = create_renderer(tok, CustomRendererConfig(import_path=IMPORT_PATH))
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]
    prompt = r.render(chat, add_generation_prompt=True).token_ids
    follow = [{"role": "user", "content": "Again, shorter."}]
    reply = tok.encode("4", add_special_tokens=False) + [tok.eos_token_id]
    bridged = r.bridge_to_next_turn(prompt, reply, follow)
    whole = r.render(chat + [{"role": "assistant", "content": "4"}] + follow, add_generation_prompt=True).token_ids
    assert bridged.token_ids == whole  # a reply that re-renders identically: the same ids as a full render
    assert bridged.message_indices[:len(prompt) + len(reply)] == [-1] * (len(prompt) + len(reply))
    assert 0 in bridged.message_indices and len(bridged.message_indices) == len(bridged.token_ids)
    cut = [17, 250, 33]  # cut by the length limit, ids that would not survive decode -> encode
    bridged = r.bridge_to_next_turn(prompt, cut, follow)
    assert bridged.token_ids[:len(prompt) + 3] == prompt + cut  # verbatim
    assert bridged.token_ids[len(prompt) + 3] == tok.eos_token_id  # the close the template would add
    assert bridged.token_ids[len(prompt) + 4:] == whole[len(prompt) + len(reply):]
