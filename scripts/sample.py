"""Sample images from U-ViT / U-ViC checkpoints into an image grid (and optional PNGs).

This file runs `uvic.cli.sample` (installed as `uvic-sample`); see there for the options.
"""

import sys

from uvic.cli.sample import main

if __name__ == "__main__":
    sys.exit(main())
