"""Sampling throughput of U-ViT and U-ViC and the projected wall time of a full FID run.

This file runs `uvic.cli.bench_sampling` (installed as `uvic-bench-sampling`); see there for
the options.
"""

import sys

from uvic.cli.bench_sampling import main

if __name__ == "__main__":
    sys.exit(main())
