"""``python -m megatron_s2.cli ...``: the ``megatron-s2`` command (the launcher starts ranks this way)."""

import sys

from megatron_s2.cli import main

sys.exit(main())
