"""Run a user's script as `ddtrain start` will: zero-code instrumentation first.

    torchrun --nproc-per-node 2 tests/scripts/autowatch_run.py SCRIPT [ARGS...]

(A stand-in for the launch side in tests; the real one is ddtrain start.)
"""

import runpy
import sys

from ddtop.training.autowatch import install

if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = sys.argv[1:]  # before install(): the hello names the program from argv[0]
    install()
    runpy.run_path(script, run_name="__main__")
