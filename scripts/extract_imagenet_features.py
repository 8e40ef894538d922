"""Extract ImageNet 256 / 512 latent features (the release's crop, with mirror images).

This file runs `uvic.cli.extract_imagenet` (installed as `uvic-extract-imagenet`); see there
for the options.
"""

import sys

from uvic.cli.extract_imagenet import main

if __name__ == "__main__":
    sys.exit(main())
