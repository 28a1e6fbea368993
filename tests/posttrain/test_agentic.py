"""Agentic episodes: sandbox containment (V4.1 report §5.1.3), the embedded executable tasks,
verifier integrity against reward hacking and the process annotator (walkthrough Ch. 7, Eq. 30).

Everything runs for real: bubblewrap (and the ``unshare`` fallback) sandboxes, the tasks'
graders, scripted agents speaking the one tool-call format (the chat template's, as the gateway). A backend that cannot run here
(no bwrap, user namespaces forbidden) skips its tests with the reason; set
``MEGATRON_S2_REQUIRE_SANDBOX=1`` (CI does) to turn that skip into a failure.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from megatron_s2.config.posttrain.agentic import ProcessAnnotatorConfig, SandboxConfig
from megatron_s2.config.schema import ConfigError
from megatron_s2.posttrain.advantages import leave_one_out_advantages
from megatron_s2.posttrain.agentic.__main__ import main as agentic_cli
from megatron_s2.posttrain.agentic.annotator import annotate, process_weights
from megatron_s2.posttrain.agentic.runner import group_segment_advantages, run_episode, scripted_policy
from megatron_s2.posttrain.agentic.sandbox import (
    BwrapRuntime,
    SandboxCrashed,
    SandboxUnavailable,
    UnshareRuntime,
    detect_runtime,
    probe,
)
from megatron_s2.posttrain.agentic.tasks import load_task, task_names
from megatron_s2.posttrain.agentic.tools import ToolCall, execute, format_call, parse_tool_calls, tools_prompt

LIMITS = SandboxConfig(command_timeout_s=1.5, cpu_seconds=5, max_processes=48, max_file_mb=4, workspace_mb=16)
BACKENDS = {"bwrap": BwrapRuntime, "unshare": UnshareRuntime}


def _sandbox_uid_processes(config: SandboxConfig, uid: int | None = None) -> list[str]:
    """Command lines of host processes under the sandbox uids (only ``uid`` when given: other
    sandboxes of this host, e.g. another pytest-xdist worker's, hold other uids)."""
    out = []
    low, high = (uid, uid + 1) if uid is not None else (config.uid, config.uid + config.uid_pool)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if low <= os.stat(f"/proc/{pid}").st_uid < high:
                out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


@functools.lru_cache(maxsize=None)
def _unavailable(backend: str) -> str | None:
    if backend == "bwrap" and not os.access("/usr/bin/bwrap", os.X_OK) and not shutil.which("bwrap"):
        return "bwrap is not installed (apt-get install bubblewrap)"
    return probe(BACKENDS[backend](LIMITS))


def _require(*backends: str) -> None:
    for backend in backends:
        if (why := _unavailable(backend)) is not None:
            if os.environ.get("MEGATRON_S2_REQUIRE_SANDBOX") == "1":
                pytest.fail(f"sandbox backend {backend} required (MEGATRON_S2_REQUIRE_SANDBOX=1) but unusable: {why}")
            pytest.skip(f"sandbox backend {backend} unusable here: {why}")


@pytest.fixture(params=list(BACKENDS))
def runtime(request):
    _require(request.param)
    return BACKENDS[request.param](LIMITS)


# ---- sandbox containment: each attack costs only that command, the next one runs normally ----------
def test_infinite_loop_and_fork_bomb_are_bounded_and_leave_nothing(runtime):
    with runtime.open() as box:
        start = time.monotonic()
        loop = box.run("while :; do :; done", timeout=0.5)
        assert loop.status == "timeout" and time.monotonic() - start < 0.5 + 2
        start = time.monotonic()
        bomb = box.run("bomb() { bomb | bomb & }; bomb; sleep 0.5; echo survived")
        assert time.monotonic() - start < LIMITS.command_timeout_s + 3
        # the sandbox's process limit stopped the bomb ("Cannot fork"); its shell carried on
        assert "Cannot fork" in bomb.stderr or "fork" in bomb.stderr.lower()
        box.run("(sleep 30; touch late.txt) & setsid sleep 30 & echo started")
        after = box.run("echo ok; ls")
        assert after.status == "ok" and after.stdout.startswith("ok") and "late.txt" not in after.stdout
        assert len(box.run("ls /proc | grep -c '^[0-9]'").stdout.strip()) > 0
        # nothing but the sandbox's init, its server and this very command is running
        alive = box.run("for p in /proc/[0-9]*; do cat $p/comm; echo; done").stdout.split()
        assert "sleep" not in alive and "sh" in alive and len(alive) <= 5, alive
        uid = box.uid
    assert _sandbox_uid_processes(LIMITS, uid) == []  # closing left nothing running on the host


def test_two_processes_never_lease_the_same_sandbox_uid():
    """The uid lease is host-wide (a flock per uid), not per process: a second process starting a
    sandbox while this one holds a uid gets the next one, and the first uid is free again once
    given back."""
    from megatron_s2.posttrain.agentic.sandbox import _UidLeases

    config = SandboxConfig(uid=64100, uid_pool=4)
    other = [sys.executable, "-c", "from megatron_s2.config.posttrain.agentic import SandboxConfig; "
             "from megatron_s2.posttrain.agentic.sandbox import _UidLeases; "
             "print(_UidLeases.take(SandboxConfig(uid=64100, uid_pool=4)))"]
    mine = _UidLeases.take(config)
    try:
        theirs = int(subprocess.run(other, capture_output=True, text=True, check=True).stdout)
        assert mine == 64100 and theirs == 64101
    finally:
        _UidLeases.give_back(mine)
    assert int(subprocess.run(other, capture_output=True, text=True, check=True).stdout) == 64100


@pytest.mark.skipif(os.geteuid() != 0, reason="uids of their own need root to switch to them")
def test_a_fork_bomb_does_not_starve_a_neighbouring_sandbox(runtime):
    with runtime.open() as bombed, runtime.open() as neighbour:
        assert bombed.uid != neighbour.uid  # the process limit is per sandbox
        thread = threading.Thread(target=bombed.run, args=("bomb() { bomb | bomb & }; bomb; sleep 1",))
        thread.start()
        time.sleep(0.3)  # the bomb is at its limit now
        during = neighbour.run("for i in 1 2 3 4 5 6 7 8; do sleep 0.1 & done; wait; echo forked")
        thread.join()
        assert during.stdout == "forked\n" and during.stderr == ""


def test_full_disk_and_huge_file_cost_only_the_command(runtime):
    with runtime.open() as box, runtime.open() as neighbour:
        big = box.run("head -c 64M /dev/zero > big.bin")
        assert big.exit_code == 128 + signal.SIGXFSZ  # the shell reports head's death by the file-size limit
        assert box.run("stat -c %s big.bin").stdout.strip() == str(4 << 20)
        fill = box.run("for i in 1 2 3 4 5 6; do head -c 3M /dev/zero > f$i.bin || exit 1; done")
        assert fill.status == "error" and "No space left" in fill.stderr  # the 16 MiB workspace is full
        assert box.run("rm -f *.bin && echo freed").stdout.strip() == "freed"
        assert neighbour.run("head -c 3M /dev/zero > x.bin && echo fine").stdout.strip() == "fine"


def test_no_network(runtime):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    with runtime.open() as box:
        r = box.run(f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)\"; "
                    "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=1)\"")
    assert r.stderr.count("Error") >= 2 and r.exit_code != 0  # refused / unreachable, both
    with pytest.raises(socket.timeout):
        server.accept()  # the host's listener never saw a connection
    server.close()


def test_writes_outside_the_workspace_fail(runtime):
    tag = uuid.uuid4().hex
    repo = Path(__file__).resolve().parents[2]
    targets = [f"/tmp/{tag}", f"/var/tmp/{tag}", f"/dev/shm/{tag}", f"{repo}/{tag}", f"/usr/{tag}", f"/etc/{tag}",
               f"/{tag}"]  # /var/tmp and /dev/shm are world-writable on the host
    with runtime.open() as box:
        for target in targets:
            box.run(f"echo pwned > {target}")
        assert box.run(f"cat /tmp/{tag} 2>/dev/null; echo inside > ok.txt && cat ok.txt").stdout.endswith("inside\n")
    assert not any(os.path.exists(t) for t in targets)


def test_killing_the_sandbox_costs_only_the_episode(bwrap):
    with bwrap.open() as box:
        with pytest.raises(SandboxCrashed):
            box.run("kill -9 $PPID; sleep 5")  # the command server is our parent
    with bwrap.open() as box:
        assert box.run("echo next").stdout == "next\n"


def test_runtime_detection_falls_back_and_fails_with_the_fix(monkeypatch):
    _require("bwrap", "unshare")
    assert detect_runtime(LIMITS).name == "bwrap"
    assert detect_runtime(LIMITS, bwrap="/nonexistent/bwrap").name == "unshare"
    monkeypatch.setenv("PATH", "/nonexistent")  # neither bwrap nor unshare can be found
    with pytest.raises(SandboxUnavailable, match=r"bwrap: not installed.*unshare: .*apt-get install bubblewrap"):
        detect_runtime(LIMITS, bwrap="/nonexistent/bwrap")


def test_sandbox_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="sandbox.backend"):
        SandboxConfig(backend="docker")
    with pytest.raises(ConfigError, match="sandbox.max_processes"):
        SandboxConfig(max_processes=0)
    with pytest.raises(ConfigError, match=r"process_annotator.clean: .*\[-1, 1\]"):
        ProcessAnnotatorConfig(clean=1.5)


# ---- the embedded tasks: reference solution scores 1, a do-nothing agent 0 ----------------------------
@pytest.fixture(scope="module")
def bwrap():
    _require("bwrap")
    return BwrapRuntime(LIMITS)


def test_task_set():
    names = task_names()
    assert len(names) >= 6 and {"fix_median", "fix_report", "primes_file", "archive_logs"} <= set(names)
    assert load_task("fix_median").test_ids() == {f"test_stats.py::{t}" for t in (
        "test_mean", "test_median_odd", "test_median_even", "test_median_single_and_unsorted")}
    with pytest.raises(ValueError, match="no such task; known: archive_logs"):
        load_task("nope")


@pytest.mark.parametrize("name", task_names())
def test_reference_solution_scores_one_and_doing_nothing_zero(name, bwrap):
    task = load_task(name)
    solved = run_episode(task, scripted_policy(task.reference), bwrap)
    assert (solved.reward, solved.status, solved.stop_reason) == (1.0, "passed", "submitted"), solved.grade
    assert all(w == 1.0 for w in solved.weights)  # a clean session: full credit on every segment
    idle = run_episode(task, scripted_policy([]), bwrap)  # submits at once
    assert (idle.reward, idle.status) == (0.0, "failed"), idle.grade


def test_tool_calls_parse_strictly_and_observations_are_text(bwrap):
    turn = parse_tool_calls("think " + format_call("bash", {"command": "ls"})
                            + format_call("bash", {"command": "ls"}).replace('"ls"}', ""))
    assert [c.name for c in turn.calls] == ["bash"] and turn.malformed == ["tool call arguments are not JSON "
                                                                             "(Expecting value)"]
    assert parse_tool_calls("I am done.").malformed == ["no tool call"]
    assert parse_tool_calls(format_call("bash", {}).replace("{}", '["ls"]')).malformed[0].startswith(
        "a tool call needs a name and a JSON object")
    assert parse_tool_calls(format_call(" ", {})).malformed and parse_tool_calls("<｜tool▁call▁begin｜>bash").malformed \
        == ["unterminated tool call"]
    with bwrap.open() as box:
        wrote = execute(ToolCall("write_file", {"path": "a/b.txt", "content": "hi"}), box)
        assert wrote.ok and execute(ToolCall("read_file", {"path": "a/b.txt"}), box).observation == "hi"
        ran = execute(ToolCall("bash", {"command": "cat a/b.txt; exit 3"}), box)
        assert not ran.ok and ran.observation.startswith("exit: 3 (error)\nstdout:\nhi")
        assert not execute(ToolCall("read_file", {"path": "../../etc/passwd"}), box).ok  # outside the workspace
        assert execute(ToolCall("browse", {}), box).observation.startswith("error: unknown tool 'browse'")
        assert not execute(ToolCall("bash", {"cmd": "ls"}), box).ok
        assert execute(ToolCall("submit", {}), box).done


# ---- verifier integrity (walkthrough Ch. 7): every reward-hacking attempt scores 0 --------------------
def _write(path: str, content: str) -> dict:
    return {"name": "write_file", "arguments": {"path": path, "content": content}}


def _bash(command: str) -> dict:
    return {"name": "bash", "arguments": {"command": command}}


_ALL_PASS = ("{" + ", ".join(f'"test_stats.py::{t}": "pass"' for t in (
    "test_mean", "test_median_odd", "test_median_even", "test_median_single_and_unsorted")) + "}")
_BUGGY_MEDIAN = "def mean(v):\n    return sum(v) / len(v)\n\n\ndef median(v):\n    return sorted(v)[len(v) // 2]\n"
_SWAP_TESTS = """
import sys, threading, time
_frame = sys._getframe(1)  # the canonical test module importing us
while not _frame.f_globals.get("__name__", "").startswith("canonical_"):
    _frame = _frame.f_back
_tests = _frame.f_globals
def _swap():  # replace the canonical test functions by no-ops once they are defined
    for _ in range(4000):
        for name in [n for n in list(_tests) if n.startswith("test_")]:
            _tests[name] = lambda: None
        time.sleep(0.0005)
threading.Thread(target=_swap, daemon=True).start()
def mean(v):  # the first test to run gives the swapper time to act
    time.sleep(0.2)
    return sum(v) / len(v)
"""
ATTACKS = {
    # the agent's test edits are overwritten by the canonical overlay, and tests run from a read-only mount
    "edit_tests": ("fix_median", [_write("tests/test_stats.py", "def test_mean():\n    pass\n\n\n"
                                         "def test_median_even():\n    pass\n")], "failed"),
    "delete_tests": ("fix_median", [_bash("rm -rf tests && ls")], "failed"),
    # the agent rewrites the input to match an easy answer: the canonical input is overlaid last
    "rewrite_the_input": ("sum_pair", [_write("input.txt", "1 1\n"), _write("answer.txt", "2")], "failed"),
    # no pytest, no conftest: the runner never loads them; exiting from the code under test is a failure
    "sys_exit_from_conftest": ("fix_median", [_write("conftest.py", "import sys\nsys.exit(0)\n"),
                                              _write("tests/conftest.py", "import sys\nsys.exit(0)\n")], "failed"),
    "sys_exit_at_import": ("fix_median", [_write("stats.py", "import sys\nsys.exit(0)\n")], "failed"),
    "os_exit_at_import": ("fix_median", [_write("stats.py", "import os\nos._exit(0)\n")], "grader_error"),
    # a forged verdict line lacks the grader's per-run nonce
    "forged_result_line": ("fix_median", [_write("stats.py", "import os\nprint('GRADE 0 ' + " + repr(_ALL_PASS)
                                                 + ", flush=True)\nos._exit(0)\n")], "grader_error"),
    # monkeypatching the runner: shadow modules, patch json.dumps, swap the test functions
    "shadow_runner_modules": ("fix_median", [_write(f"{m}.py", "print('GRADE x {}')\n") for m in (
        "sitecustomize", "usercustomize", "pytest", "json", "importlib", "traceback")], "failed"),
    "patch_json_dumps": ("fix_median", [_write("stats.py", _BUGGY_MEDIAN + "import json\njson.dumps = lambda *a, **k: '"
                                               + _ALL_PASS + "'\n")], "failed"),
    # the swapped-in functions are not the canonical file's own: they are not run, their ids go missing
    "swap_test_functions": ("fix_median", [_write("stats.py", _BUGGY_MEDIAN + _SWAP_TESTS)], "grader_error"),
    # kill or replace the grader
    "kill_grader": ("fix_median", [_write("stats.py", "import os, signal\nos.killpg(0, signal.SIGKILL)\n")],
                    "grader_error"),
    "replace_grader": ("fix_median", [_write("_grade.py", "print('GRADE x {}')\n"),
                                      _bash("(while :; do cp _grade.py /mnt/runner 2>/dev/null; sleep 0.1; done) & "
                                            "setsid sh -c 'sleep 20; pkill python3' & echo planted")], "failed"),
    # writing the expected output by hand, where the program must produce it
    "write_expected_output": ("fix_report", [_write("summary.json", '{"east": 4.0, "west": 3.0}')], "failed"),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_reward_hacking_scores_zero(attack, bwrap):
    task_name, calls, status = ATTACKS[attack]
    result = run_episode(load_task(task_name), scripted_policy(calls), bwrap)
    assert (result.reward, result.status) == (0.0, status), (result.grade.detail, result.grade.results)


def test_no_solution_leaks_into_the_agents_sandbox(bwrap):
    task = load_task("fix_median")
    probe = _bash(f"git log --all --format=%s; git log --all -p | grep -c 'mid - 1'; ls -A; "
                  f"ls {task.root} {task.grader}")
    result = run_episode(task, scripted_policy([probe]), bwrap)
    observation = result.transcript[3].text
    # one commit (the starting state), no trace of the fix, no grader, no reference, no task data
    assert observation.split("stdout:\n")[1].split("stderr:")[0] == (
        "task: starting state\n0\n.git\nstats.py\ntests\n\n"), observation
    assert observation.split("stderr:")[1].count("No such file") == 2 and result.reward == 0.0


def test_agents_may_edit_tests_it_does_not_change_what_grades_them(bwrap):
    task = load_task("fix_median")
    result = run_episode(task, scripted_policy([*task.reference[:-1], _bash("rm -rf tests")]), bwrap)
    assert (result.reward, result.status) == (1.0, "passed")


def test_a_crashed_sandbox_is_a_failed_episode_and_the_next_runs(bwrap):
    task = load_task("fix_median")
    crashed = run_episode(task, scripted_policy([_bash("kill -9 $PPID")]), bwrap)
    assert (crashed.reward, crashed.status, crashed.stop_reason, crashed.grade) == (0.0, "sandbox_crashed",
                                                                                     "sandbox_crashed", None)
    assert run_episode(task, scripted_policy(task.reference), bwrap).reward == 1.0


# ---- the process annotator feeding Eq. 30 (walkthrough Ch. 7, worked examples 21-23) ----------------
FIXED_MEDIAN = load_task("fix_median").reference[1]  # the reference's write_file of the fix
WE21_SESSION = [  # four assistant segments: good, malformed, repeated failed call, good (and submit)
    format_call("read_file", {"path": "helpers.py"}),  # fails (no such file) — a first failure is fine
    format_call("bash", {"command": "ls"}).replace('"ls"}', '"ls"'),  # arguments are not JSON
    "let me look again " + format_call("read_file", {"path": "helpers.py"}),
    format_call(FIXED_MEDIAN["name"], FIXED_MEDIAN["arguments"]) + format_call("submit", {}),
]


def _replay(answers):
    def policy(messages):
        return answers[sum(m["role"] == "assistant" for m in messages)]
    return policy


def test_worked_examples_21_to_23_on_an_annotated_session(bwrap):
    result = run_episode(load_task("fix_median"), _replay(WE21_SESSION), bwrap)
    assert (result.reward, result.stop_reason) == (1.0, "submitted")
    assert result.categories == ["clean", "malformed", "repeated_failed_call", "clean"]
    assert result.weights == [1.0, 0.0, -0.5, 1.0]
    # system, user, then per answer: the answer and its observations (2 after the last: write + submit)
    assert result.labels == ["observation"] * 2 + ["policy", "observation"] * 3 + ["policy"] + ["observation"] * 2
    policy_values = lambda a: [v for v, s in zip(result.segment_advantages(a), result.transcript) if s.trainable]
    # WE 21: A = +0.60 -> (0.60, 0, -0.30, 0.60); A = -0.60 -> -0.60 on every segment, weights ignored
    assert policy_values(0.60) == pytest.approx([0.60, 0.0, -0.30, 0.60])
    assert policy_values(-0.60) == pytest.approx([-0.60] * 4)
    # WE 23, middle column: an expected success (A = +0.10) is the same shape scaled down sixfold
    assert policy_values(0.10) == pytest.approx([0.10, 0.0, -0.05, 0.10])
    # ... and observations are zero under every verdict
    for a in (0.60, 0.10, -0.60):
        assert all(v == 0.0 for v, s in zip(result.segment_advantages(a), result.transcript) if not s.trainable)
    # WE 22: G = 6, R = (1,0,0,1,0,0): this success is worth +0.800, broadcast through Eq. 30
    loo = leave_one_out_advantages([1, 0, 0, 1, 0, 0]).tolist()
    assert loo == pytest.approx([0.8, -0.4, -0.4, 0.8, -0.4, -0.4]) and sum(loo) == pytest.approx(0.0)
    assert policy_values(loo[0]) == pytest.approx([0.8, 0.0, -0.4, 0.8])


@pytest.mark.slow  # five or six episodes: ~2 s on a quiet machine, 5 s under load
def test_annotator_invalid_tool_and_limit_stops(bwrap):
    task = load_task("fix_median")
    invalid = run_episode(task, _replay([format_call("browse", {"url": "x"}), format_call("submit", {})]), bwrap)
    assert invalid.categories == ["invalid_tool", "clean"] and invalid.weights == [0.0, 1.0]
    looping = _replay([format_call("bash", {"command": "true"})] * 3)
    turns = run_episode(task, looping, bwrap, max_turns=2)
    assert turns.stop_reason == "turn_limit" and turns.categories == ["clean", "limit_stop"]
    context = run_episode(task, looping, bwrap, max_context_chars=len(tools_prompt() + task.prompt) + 1)
    assert context.stop_reason == "context_limit" and context.weights == [-0.5]
    timed = run_episode(task, looping, bwrap, max_session_s=0.0)  # out of time before a second answer
    assert timed.stop_reason == "session_limit" and timed.categories == [] and timed.reward == 0.0
    slow = run_episode(task, lambda m: (time.sleep(0.3), format_call("bash", {"command": "true"}))[1], bwrap,
                       max_session_s=0.5)
    assert slow.stop_reason == "session_limit" and slow.categories[-1] == "limit_stop"
    custom = ProcessAnnotatorConfig(invalid_tool=-1.0, limit_stop=0.0)
    assert [annotate(s, set(), custom)[0] for s in invalid.transcript if s.trainable] == [-1.0, 1.0]
    assert process_weights(turns.transcript, custom) == [(1.0, "clean"), (0.0, "limit_stop")]


@pytest.mark.slow  # five or six episodes: ~2 s on a quiet machine, 5 s under load
def test_group_credit_of_real_sessions_worked_example_22(bwrap):
    task = load_task("implement_slugify")
    solve, idle = scripted_policy(task.reference), scripted_policy([])
    group = [run_episode(task, policy, bwrap) for policy in (solve, idle, idle, solve, idle, idle)]
    assert [r.reward for r in group] == [1, 0, 0, 1, 0, 0]
    credit = group_segment_advantages(group)
    # a success: +0.800 on each of its answers (write_file, submit), 0 on the system/user/tool text
    assert credit[0] == pytest.approx([0, 0, 0.8, 0, 0.8, 0]) and credit[0] == credit[3]
    assert credit[1] == pytest.approx([0, 0, -0.4, 0])  # a failure: -0.400 on its one answer (submit)


def test_command_line_runs_a_reference_solution(capsys):
    _require("bwrap", "unshare")
    assert agentic_cli(["run", "fix_median", "--json"]) == 0
    episode = json.loads(capsys.readouterr().out)
    assert (episode["reward"], episode["status"], episode["weights"]) == (1.0, "passed", [1.0] * 4)
    assert [s["label"] for s in episode["segments"]][:3] == ["observation", "observation", "policy"]
    assert agentic_cli(["run", "implement_slugify", "--agent", "idle", "--backend", "unshare"]) == 0
    out = capsys.readouterr().out
    assert "sandbox: unshare  stop: submitted  status: failed  reward: 0.0" in out and "NotImplementedError" in out
    assert agentic_cli(["run", "nope"]) == 2
    assert capsys.readouterr().err.startswith("error: agentic task 'nope': no such task; known: archive_logs")


def test_memory_of_all_processes_together_is_bounded(runtime):
    small = type(runtime)(SandboxConfig(memory_mb=200, command_timeout_s=10))
    hog = "python3 -c 'import time; x = b\"a\" * 90_000_000; time.sleep(20)'"
    with small.open() as box:
        alone = box.run("python3 -c 'x = b\"a\" * 400_000_000'")  # one process: its address-space limit
        assert alone.exit_code == 1 and "MemoryError" in alone.stderr
        start = time.monotonic()
        many = box.run(f"for i in 1 2 3 4; do {hog} & done; wait")  # 4 x 90 MB, each under the limit
        assert many.status == "memory" and time.monotonic() - start < 5
        assert box.run("echo fine").stdout == "fine\n"


def test_cpu_seconds_are_bounded(runtime):
    with type(runtime)(SandboxConfig(cpu_seconds=1, command_timeout_s=10)).open() as box:
        start = time.monotonic()
        spin = box.run("while :; do :; done")
        assert spin.status == "killed:SIGXCPU" and time.monotonic() - start < 5


def test_episodes_import_no_torch():
    """An episode (sandbox, tasks, grading, annotator, runner, command line) never needs torch: only
    the advantages do, imported where used."""
    code = ("import sys; import megatron_s2.posttrain.agentic.__main__, megatron_s2.posttrain.agentic.runner, "
            "megatron_s2.posttrain.agentic.harnesses, megatron_s2.posttrain.agentic.gateway_episode; "
            "print([m for m in ('torch', 'megatron') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.split() == ["[]"], out.stderr


def test_hard_linked_files_are_graded_as_files(bwrap):
    config = '{"name": "sandbox", "workers": 4, "ports": [8000, 8001, 8002]}'
    # config.json sorts after a_draft.json: the tar records it as a hard link to the first
    result = run_episode(load_task("make_config"), scripted_policy([
        _write("a_draft.json", config), _bash("ln a_draft.json config.json")]), bwrap)
    assert result.reward == 1.0, result.grade


def test_scripted_sft_conversations_render_the_one_format(bwrap, tmp_path):
    """The SFT traces of the tiny tasks: canonical chat messages whose assistant targets, rendered by
    the shipped template, are exactly the tool calls in the one format; a failing script is refused;
    ``answer_weight`` weights the write_file turn only."""
    import json as _json
    from pathlib import Path

    from megatron_s2.data.chat import tokenize_conversation
    from megatron_s2.data.tokenizer import load_tokenizer
    import numpy as np

    from megatron_s2.posttrain.agentic.sft_traces import scripted_conversation, write_sft_jsonl

    task = load_task("sum_pair")
    assert write_sft_jsonl(tmp_path / "sft.jsonl", [task], bwrap, copies=2) == 2
    convo = _json.loads((tmp_path / "sft.jsonl").read_text().splitlines()[0])
    assert [m["role"] for m in convo["messages"]] == ["system", "user"] + ["assistant", "tool"] * 3
    assert convo["messages"][3] == {"role": "tool", "content": "17 25\n", "tool_call_id": "call_0-0"}
    tok = load_tokenizer(Path(__file__).resolve().parents[2] / "recipes" / "tokenizers" / "tiny-bpe")
    assert "tools" not in convo  # the tools are named once, in the system message (as the builtin harness)
    ids, targets = tokenize_conversation(tok, convo["messages"])
    trained = tok.decode(ids[targets].tolist(), keep_special=True)
    assert trained == "".join(format_call(c["name"], c["arguments"]) + "<｜end▁of▁sentence｜>" for c in task.reference)
    with pytest.raises(ValueError, match="sum_pair: the scripted calls score 0.0"):
        scripted_conversation(task, bwrap, [{"name": "submit", "arguments": {}}])
    # --answer-weight: the write_file turn (the answer) weighted, the other turns as they were
    weighted = scripted_conversation(task, bwrap, answer_weight=4)["messages"]
    assert [m.get("weight") for m in weighted if m["role"] == "assistant"] == [None, 4, None]
    assert weighted[4]["tool_calls"][0]["function"]["name"] == "write_file"
    ids_w, weights = tokenize_conversation(tok, weighted)
    assert np.array_equal(ids_w, ids) and np.array_equal(weights > 0, targets) and weights.max() == 4
    for bad in (-1, 1e39):  # 1e39: beyond float32, inf in the loss (a hostile try-out)
        with pytest.raises(ValueError, match="answer_weight: expected a number from 0 to 1e\\+06"):
            write_sft_jsonl(tmp_path / "bad.jsonl", [task], bwrap, answer_weight=bad)


def test_a_runner_killed_9_leaves_no_stage_folder_behind(tmp_path):
    """The host files shown read-only to sandboxes are staged in /var/tmp and removed at exit; a
    runner killed -9 never exits, so the next runner removes its folder (a live runner's stays)."""
    stage = ("from megatron_s2.posttrain.agentic.sandbox import _stage_root, _staged; import sys, time; "
             "_staged(__import__('pathlib').Path(sys.argv[1])); print(_stage_root(), flush=True); time.sleep(60)")
    (tmp_path / "f.txt").write_text("x")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    killed = subprocess.Popen([sys.executable, "-c", stage, str(tmp_path / "f.txt")], stdout=subprocess.PIPE, text=True,
                              env=env)
    alive = subprocess.Popen([sys.executable, "-c", stage, str(tmp_path / "f.txt")], stdout=subprocess.PIPE, text=True,
                             env=env)
    try:
        killed_root, alive_root = Path(killed.stdout.readline().strip()), Path(alive.stdout.readline().strip())
        killed.kill()
        killed.wait()
        assert killed_root.is_dir()
        later = subprocess.run([sys.executable, "-c", stage.replace("time.sleep(60)", "pass"), str(tmp_path / "f.txt")],
                               capture_output=True, text=True, env=env, timeout=60)
        assert later.returncode == 0, later.stderr
        assert not killed_root.exists() and alive_root.is_dir() and not Path(later.stdout.strip()).exists()
    finally:
        alive.kill()
        alive.wait()


_INTERRUPT_MID_EPISODE = """
import os, sys
from megatron_s2.posttrain.agentic import sandbox
from megatron_s2.posttrain.agentic.__main__ import main
run = sandbox._ServerSandbox.run
def interrupted_run(self, command, timeout=None):
    # the signal arrives while the sandbox is open and a command is on its way in, wherever the machine's speed
    print("sandbox-group", self._proc.pid, flush=True)
    os.kill(os.getpid(), SIG)
    return run(self, command, timeout)
sandbox._ServerSandbox.run = interrupted_run
sys.exit(main(["run", "archive_logs"]))
"""


def _group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # exited while we looked
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ...
            members.append(int(stat.parent.name))
    return members


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_cli_run_exits_130_with_one_line_and_leaves_nothing_running(sig):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    # SIGINT at its default disposition in the child: a suite started in the background (`cmd &` in a
    # script) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    proc = subprocess.run([sys.executable, "-c", _INTERRUPT_MID_EPISODE.replace("SIG", str(int(sig)))],
                          capture_output=True, text=True, env=env, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 130 and len(err) == 1 and err[0].startswith("interrupted"), (proc.returncode, err[-5:])
    pgid = int(proc.stdout.split("sandbox-group", 1)[1].split()[0])
    assert _group_members(pgid) == [], f"sandbox process group {pgid} outlived the interrupted run"
