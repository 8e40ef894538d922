"""Export a uvic run, checkpoint or released U-ViT as a diffusers pipeline folder.

This file runs `uvic.cli.export` (installed as `uvic-export`); see there for the options.
"""

import sys

from uvic.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
