"""Training-step speed of U-ViT vs U-ViC, per attention backend and compile mode.

This file runs `uvic.cli.bench_train` (installed as `uvic-bench-train`); see there for the
options.
"""

import sys

from uvic.cli.bench_train import main

if __name__ == "__main__":
    sys.exit(main())
