"""The U-ViT release's table end to end: train, then FID, then the table, for every row.

This file runs `uvic.cli.tables.release_table` (installed as `uvic-release-table`); see there for
the options.
"""

import sys

from uvic.cli.tables import release_table as main

if __name__ == "__main__":
    sys.exit(main())
