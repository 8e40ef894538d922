"""Reconstruct the EMA weights of any length from a run's post-hoc EMA snapshots (EDM2).

This file runs `uvic.cli.posthoc_ema` (installed as `uvic-posthoc-ema`); see there for the
options.
"""

import sys

from uvic.cli.posthoc_ema import main

if __name__ == "__main__":
    sys.exit(main())
