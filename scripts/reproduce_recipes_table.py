"""The modern-recipe table end to end: train, then FID, then the table, for every recipe row.

This file runs `uvic.cli.tables.recipes_table` (installed as `uvic-recipes-table`); see there for
the options.
"""

import sys

from uvic.cli.tables import recipes_table as main

if __name__ == "__main__":
    sys.exit(main())
