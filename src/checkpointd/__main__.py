"""``python -m checkpointd``: the same as the ``checkpointd`` command."""

import sys

from checkpointd.cli.main import main

sys.exit(main())
