"""``python -m persist_pipeline``: the command-line tool."""

from __future__ import annotations

import sys

from persist_pipeline.cli import main

sys.exit(main())
