"""``python -m arrow_outputs.demo [options]``: the same as ``arrow-outputs demo``."""

from __future__ import annotations

from .cli import main

raise SystemExit(main())
