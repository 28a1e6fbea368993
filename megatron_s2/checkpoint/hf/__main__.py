"""``python -m megatron_s2.checkpoint.hf export|import ...`` (see :mod:`.cli`)."""

import sys

from megatron_s2.checkpoint.hf.cli import main

sys.exit(main())
