"""The client-played episode backend (verifiers / agentic kinds) collects an episode only once its
done-callback has noted the engine's policy version: a concurrent future reports done() before its
callbacks run, and a 256-episodes-a-step verifiers run on a loaded machine stopped at step 25 reading
that window as an update that overlapped the episode ("version 24 -> -1"). Threads only, no engine:
the stand-in holds the one attribute the backend reads (``policy_version``) and records pause()."""

from __future__ import annotations

import concurrent.futures
import threading

from megatron_s2.posttrain.rollout.episode_backend import EpisodeBackend, EpisodeRun
from megatron_s2.posttrain.rollout.replicas import ReplicaTopology


class _Engine:
    def __init__(self, version: int):
        self.policy_version, self.paused = version, False

    def pause(self):
        self.paused = True


class _Backend(EpisodeBackend):
    started = True

    def _start(self):
        pass

    def _launch(self):
        pass

    def _sample(self, run):
        return run.version, run.end_version


def _run_in_the_window(backend):
    """An episode whose future is done while its backend done-callback has not run yet (a callback
    registered before it blocks); returns the run and the event that lets the callbacks go on."""
    future, go, entered = concurrent.futures.Future(), threading.Event(), threading.Event()
    future.add_done_callback(lambda _: (entered.set(), go.wait(10)))
    run = backend._running[0] = EpisodeRun(None, backend.engine.policy_version, future)
    future.add_done_callback(lambda _: backend._finished(run))
    thread = threading.Thread(target=future.set_result, args=("trace",), daemon=True)
    thread.start()
    assert entered.wait(10) and future.done() and run.end_version == -1  # the window
    return run, go, thread


def _backend():
    return _Backend(_Engine(version=24), {}, tokenizer=None, topology=ReplicaTopology.single(), layer_ids=[],
                    record_routing=False, max_concurrent=4)


def test_a_done_episode_is_collected_only_after_its_callback_noted_the_version():
    backend = _backend()
    run, go, thread = _run_in_the_window(backend)
    assert backend._collect() == 0 and 0 in backend._running  # not yet: its version is unknown
    go.set()
    thread.join(10)
    assert backend._collect() == 1 and backend._done == [(24, 24)] and not backend._running


def test_pause_returns_only_after_every_episode_noted_its_version():
    backend = _backend()
    run, go, thread = _run_in_the_window(backend)
    pausing = threading.Thread(target=backend.pause, daemon=True)
    pausing.start()
    pausing.join(0.3)
    assert pausing.is_alive() and not backend.engine.paused  # waits for the callback, not only done()
    go.set()
    pausing.join(10)
    assert backend.engine.paused and run.end_version == 24
    backend.engine.policy_version = 25  # the update after the pause does not reach the finished episode
    assert backend._collect() == 1 and backend._done == [(24, 24)]
