"""The one driver loop (server, rollouts, ``generate``): side tasks run one per iteration between
engine steps — so a long scoring request is interleaved with decoding — never while the engine
is paused; a failed step stops the driver and tells every waiter; new work wakes the loop."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_s2.inference import DriverStopped, EngineConfig, EngineDriver, InferenceEngine, SamplingParams
from megatron_s2.models.v41.model import build_model

PROMPT = list(range(5, 14))


@pytest.fixture(scope="module")
def model(tiny_cfg):
    return build_model(tiny_cfg, seed=0).eval()


def new_engine(model):
    return InferenceEngine(model, EngineConfig(max_num_seqs=2, max_model_len=64, page_tokens=8))


def test_side_tasks_interleave_with_decoding_one_per_iteration(model):
    engine = new_engine(model)
    driver = EngineDriver(engine)
    events = []
    handle = engine.submit(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for i in range(4):  # e.g. four batches of one request's prompt log-probabilities
        driver.submit_task(lambda i=i: events.append(f"task{i}") or i, lambda result, error: events.append(result))
    real_step = engine.step
    engine.step = lambda: (events.append("step"), real_step())[1]
    while engine.has_work() or driver._tasks:
        driver.step()
    assert events[:12] == ["task0", 0, "step", "task1", 1, "step", "task2", 2, "step", "task3", 3, "step"]
    assert handle.result(timeout=0).token_ids == engine.generate([PROMPT], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids


def test_no_side_task_runs_while_paused(model):
    engine = new_engine(model)
    driver = EngineDriver(engine)
    ran = []
    engine.pause()
    driver.submit_task(lambda: ran.append(engine.paused), lambda result, error: None)
    driver.step()
    assert ran == []
    engine.resume()
    driver.step()
    assert ran == [False]


def test_a_failed_step_stops_the_driver_and_tells_every_waiter(model):
    engine = new_engine(model)
    failures, delivered = [], []
    driver = EngineDriver(engine, on_failure=failures.append)
    engine.submit(PROMPT, SamplingParams(max_tokens=4))
    engine.executor.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
    driver.submit_task(lambda: None, lambda result, error: None)  # runs first, then the step fails
    driver.submit_task(lambda: None, lambda result, error: delivered.append(error))
    with pytest.raises(RuntimeError, match="device lost"):
        driver.step()
    assert failures == ["RuntimeError: device lost"] and isinstance(delivered[0], DriverStopped)
    with pytest.raises(DriverStopped):
        driver.step()
    with pytest.raises(DriverStopped):
        driver.submit_task(lambda: None, lambda result, error: None)


def test_background_loop_wakes_on_new_work_and_stop_releases_queued_tasks(model):
    engine = new_engine(model)
    driver = EngineDriver(engine, idle_wait_s=30.0)  # only a wake-up can make it step in time
    driver.start()
    try:
        time.sleep(0.1)  # the loop is idle, waiting
        started = time.perf_counter()
        result = engine.submit(PROMPT, SamplingParams(max_tokens=3, temperature=0)).result(timeout=20)
        assert len(result.token_ids) == 3 and time.perf_counter() - started < 20
        with pytest.raises(RuntimeError, match="stop"):
            driver.generate([PROMPT])
    finally:
        engine.pause()  # queued tasks wait (paused) until stop() tells them
        told = threading.Event()
        driver.submit_task(lambda: None, lambda result, error: told.set() if isinstance(error, DriverStopped) else None)
        driver.stop()
    assert told.is_set() and not driver.alive
