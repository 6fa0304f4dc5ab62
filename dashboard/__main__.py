"""`python -m ddtop.dashboard` is `ddtop`."""

import sys

from ddtop.dashboard.cli import main

sys.exit(main())
