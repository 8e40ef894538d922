"""Quickstart: train a tiny U-ViT and a tiny U-ViC side by side, sample, plot, evaluate.

This file runs `uvic.cli.quickstart` (installed as `uvic-quickstart`; `make quickstart`
runs this file); see there for the options.
"""

import sys

from uvic.cli.quickstart import main

if __name__ == "__main__":
    sys.exit(main())
