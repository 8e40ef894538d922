"""Extract MS-COCO 2014 features for text-to-image U-ViT / U-ViC (the release's protocol).

This file runs `uvic.cli.extract_mscoco` (installed as `uvic-extract-mscoco`); see there
for the options.
"""

import sys

from uvic.cli.extract_mscoco import main

if __name__ == "__main__":
    sys.exit(main())
