"""Train a U-ViT / U-ViC (see uvic/training/trainer.py for what a run writes).

This file runs `uvic.cli.train` (installed as `uvic-train`); see there for the options.
"""

import sys

from uvic.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
