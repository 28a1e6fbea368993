"""The trusted test runner that grades an episode, *inside* a fresh grading sandbox (stdlib only).

Run as ``python3 -I _grade.py <tests dir> <workspace>`` with a nonce on stdin. It never loads
anything the agent controls before its own state is set up: no pytest, no conftest.py, no
plugins, no ini files (``-I``: no PYTHONPATH, no user site, no current directory on sys.path).
It imports each canonical ``test_*.py`` from the read-only tests mount (not the workspace
copy, which the code under test could rewrite), runs every ``test_*`` function the file itself
defines, and prints one line ``GRADE <nonce> <json results>`` through functions bound before any
code under test ran. The host accepts the grade only when that line is present
with its nonce, the runner exited 0, and every canonical test id is in it (walkthrough Ch. 7:
a missing or unparseable grade is a grader error, never a pass).

Limit: the code under test runs in this process (the tests import it), so code written to
rewrite the runner's live objects from inside (frames, threads) is not closed here; the nonce
only stops a canned result line. Tests that drive the agent's program as a subprocess (as
``fix_wordcount`` and ``fix_report`` do) keep it out of the process entirely.
"""

import importlib.util
import json
import os
import sys
import traceback


def main():
    tests_dir, workspace = sys.argv[1], sys.argv[2]
    nonce = sys.stdin.readline().strip()
    # everything the verdict goes through is bound before any code under test runs (it could
    # monkeypatch json.dumps or os.write at import time)
    write, fd, dumps, isinstance_, function = os.write, os.dup(1), json.dumps, isinstance, type(main)
    os.chdir(workspace)
    sys.path.append(workspace)  # after the stdlib: the workspace cannot shadow a standard module
    results = {}
    for name in sorted(os.listdir(tests_dir)):
        if not (name.startswith("test_") and name.endswith(".py")):
            continue
        try:
            spec = importlib.util.spec_from_file_location(f"canonical_{name[:-3]}", os.path.join(tests_dir, name))
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except BaseException:  # noqa: B036 — SystemExit from the code under test is a failure
            results[f"{name}::<import>"] = "fail: " + traceback.format_exc(limit=3)[-400:]
            continue
        path = os.path.join(tests_dir, name)
        for attr in sorted(vars(module)):
            fn = vars(module)[attr]
            # only functions the canonical file itself defines (not ones swapped in by the code under test)
            if attr.startswith("test_") and isinstance_(fn, function) and fn.__code__.co_filename == path:
                try:
                    fn()
                    results[f"{name}::{attr}"] = "pass"
                except BaseException:  # noqa: B036
                    results[f"{name}::{attr}"] = "fail: " + traceback.format_exc(limit=3)[-400:]
                os.chdir(workspace)
    write(fd, f"\nGRADE {nonce} {dumps(results)}\n".encode())


if __name__ == "__main__":
    main()
