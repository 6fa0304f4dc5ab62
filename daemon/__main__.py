"""`python -m ddtop.daemon` is `ddtrain`."""

import sys

from ddtop.daemon.cli import main

sys.exit(main())
