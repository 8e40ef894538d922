"""Table 3 end to end: train, then FID, then the table, for every (dataset, model) pair.

This file runs `uvic.cli.tables.table3` (installed as `uvic-table3`); see there for the options.
"""

import sys

from uvic.cli.tables import table3 as main

if __name__ == "__main__":
    sys.exit(main())
