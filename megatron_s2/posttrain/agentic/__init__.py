"""Agentic episodes in sandboxes: executable tasks, verifier integrity, process weights.

Walkthrough Ch. 7 (credit and integrity) and V4.1 report §5.1.3 (sandboxes), in miniature:

===========================================  ====================================================
piece                                        module
===========================================  ====================================================
sandbox runtime interface, bwrap / unshare   ``sandbox.py`` (+ ``_sandbox_server.py`` inside,
(report §5.1.3)                              ``_reaper.py`` outside)
embedded coding / terminal tasks             ``tasks.py`` + ``tasks/<name>/`` data
agent tools, the one tool-call format        ``tools.py``
grading with verifier integrity (Ch. 7)      ``grading.py`` (+ ``_grade.py``, the trusted runner)
process annotator, w in [-1, 1] (Eq. 30)     ``annotator.py`` (Eq. 30 itself:
                                             ``advantages/session_credit.py``)
episode runner: policy callable -> labelled  ``runner.py``, ``transcript.py``
transcript, reward, weights; group credit
(leave-one-out + Eq. 30 per segment)
real harnesses through the gateway (OpenAI   ``harnesses.py`` (adapters: sandbox tools as each
Agents SDK, anthropic, smolagents, builtin)  harness's native function tools)
one harness episode: PrefixTree trace,        ``gateway_episode.py``
grading, process weights per token span,
Eq. 30 over a group
command line (a task's reference solution)   ``__main__.py``
===========================================  ====================================================

Configuration: :mod:`megatron_s2.config.posttrain.agentic` (``sandbox``, ``process_annotator``).
Nothing here imports torch; only the harnesses speak HTTP (to the gateway).
"""
