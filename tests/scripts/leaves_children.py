"""A user's script whose every rank leaves two processes running when it exits:
a `sleep 300` started with subprocess.Popen and never waited for, and a
"prefetcher" forked and never joined (it keeps every file descriptor the rank
had, multiprocessing's pipes included). Each prints `LEFT <pid>`; with
`escape`, the forked one leaves the rank's session first (os.setsid).

usage: ddtrain start -n 2 leaves_children.py [-- escape]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

sleeper = subprocess.Popen(["sleep", "300"])
print(f"LEFT {sleeper.pid}", flush=True)
prefetcher = os.fork()
if prefetcher == 0:
    if "escape" in sys.argv[1:]:
        os.setsid()
    time.sleep(300)
    os._exit(0)
print(f"LEFT {prefetcher}", flush=True)
