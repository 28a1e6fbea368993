"""``metrics.jsonl`` after a crash: a run killed (kill -9) after logging steps 9-11 but before
their checkpoint resumed from step 8 and appended steps 9-11 again (each logged twice, and a line
torn by the kill glued to the next record). On resume the records past the resumed step and a
torn line are dropped, so every step appears once."""

from __future__ import annotations

import json

from megatron_s2.training.metrics import MetricsLogger


def _logger(run_dir):
    return MetricsLogger(run_dir, enabled=True, total_steps=12, log_interval=1, tensorboard=False,
                         progress_bar=False, flops_per_token=1.0, world_size=1, peak_tflops=None)


def test_resume_drops_records_of_steps_that_are_rerun(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 5.0 - s / 10}) for s in range(1, 12)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 12, "lo')  # torn by kill -9
    logger = _logger(tmp_path)
    logger.set_start(8)
    for step in range(9, 13):
        logger.log(step, 4.0, 1e-3, 1.0, 64, 0.1, {})
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == list(range(1, 13))


def test_fresh_run_and_clean_resume_keep_everything(tmp_path):
    logger = _logger(tmp_path)
    logger.set_start(0)
    logger.log(1, 4.0, 1e-3, 1.0, 64, 0.1, {})
    logger = _logger(tmp_path)
    logger.set_start(1)
    logger.log(2, 4.0, 1e-3, 1.0, 64, 0.1, {})
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_tensorboard_hides_the_dead_attempts_events_of_rerun_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def logger():
        return MetricsLogger(tmp_path, enabled=True, total_steps=12, log_interval=1, tensorboard=True,
                             progress_bar=False, flops_per_token=1.0, world_size=1, peak_tflops=None)

    dead = logger()
    dead.set_start(0)
    for step in range(1, 12):  # killed after logging step 11; its last checkpoint was step 8
        dead.log(step, 9.0, 1e-3, 1.0, 64, 0.1, {})
    dead.close()
    resumed = logger()
    resumed.set_start(8)
    for step in range(9, 13):
        resumed.log(step, 4.0, 1e-3, 1.0, 64, 0.1, {})
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == list(range(1, 13))
    assert [e.value for e in events if e.step > 8] == [4.0] * 4
