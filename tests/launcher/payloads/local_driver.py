"""Run a command on N local ranks through LocalRun, as `megatron-s2 launch --local` would.

    local_driver.py RUN_DIR NPROC COMMAND...

Exits with LocalRun's exit code; signals sent to this process are handled by LocalRun.
"""

import sys
from pathlib import Path

from megatron_s2.config.launcher import LauncherConfig
from megatron_s2.launcher.job import JobSpec
from megatron_s2.launcher.local import LocalRun

run_dir, nproc, command = Path(sys.argv[1]).absolute(), int(sys.argv[2]), tuple(sys.argv[3:])
job = JobSpec(name="local-test", run_dir=run_dir, command=command, nodes=1, nproc_per_node=nproc, gpus_per_node=0,
              launcher=LauncherConfig(terminate_grace_s=5.0))
sys.exit(LocalRun(job).run())
