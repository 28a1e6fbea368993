"""Run the health checks on every rank; rank 0 writes RUN_DIR/health.json and prints the report.

    health_check.py RUN_DIR
"""

import sys
from pathlib import Path

from megatron_s2.runtime.bootstrap import init_distributed, shutdown_distributed
from megatron_s2.runtime.health import run_health_checks

run_dir = Path(sys.argv[1])
info = init_distributed(backend="gloo")
report = run_health_checks(info, outlier_factor=3.0)
if info.rank == 0:
    print(report.format(), flush=True)
    (run_dir / "health.json").write_text(report.to_json())
shutdown_distributed()
