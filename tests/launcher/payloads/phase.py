"""Stand-in for one phase of a pipeline (no torch: fast).

    phase.py RUN_DIR [--fail]

Reads the resolved recipe the launcher wrote (RUN_DIR/launch/config.yaml) and records in
RUN_DIR/seen.json where it was told to start from and whether that phase had finished when
this one started; then writes RUN_DIR/FINISHED (or exits 3 with --fail).
"""

import json
import sys
import time
from pathlib import Path

import yaml

run_dir = Path(sys.argv[1])
config = yaml.safe_load((run_dir / "launch" / "config.yaml").read_text())
load = config["checkpoint"]["load"]
seen = {"load": load, "load_optimizer": config["checkpoint"]["load_optimizer"], "started": time.time(),
        "previous_finished": bool(load) and (Path(load).parent / "FINISHED").exists()}
(run_dir / "seen.json").write_text(json.dumps(seen))
time.sleep(1.0)
if "--fail" in sys.argv:
    sys.exit(3)
# like the trainer: the step reached, which is the recipe's target
(run_dir / "FINISHED").write_text(json.dumps({"step": config["training"]["train_steps"], "loss": 0.0}))
