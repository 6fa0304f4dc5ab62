"""`ddtop`: watch a ddtrain run live, in a terminal dashboard or as log lines.

    ddtop                          the newest live run under ./runs (else the newest run)
    ddtop RUN                      a run id (a unique prefix is enough) or a run directory
    ddtop --connect ENDPOINT       a daemon's control endpoint (run.json: endpoints.control)
    ddtop --replay RUN [--speed X] a run's journal played back (0: at once)
    ddtop --headless [RUN]         log lines (or --format jsonl) and the run's exit code
    ddtop --serve [HOST:]PORT [RUN] the dashboard in a browser (dashboard/serve.py)
    ddtop export RUN --tensorboard DIR   the run as TensorBoard files (dashboard/export.py)

Quitting (q) leaves the run going; `x` stops it, after asking.
Exit codes: 0 the run succeeded (or the dashboard was quit), 1 the run failed,
130 it was stopped, 2 bad input or no run reachable within --wait.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from ddtop.core.bounds import MAX_JOB_RANKS
from ddtop.core.contract import EXIT_USAGE, UsageError
from ddtop.core.flags import (
    OneLineParser,
)
from ddtop.core.flagspec import (
    add_runs_dir_argument,
    default_runs_dir,
)
from ddtop.core.rundir import NoSuchRun, RunPaths, find_run, locate_run
from ddtop.core.runinfo import list_runs

EXIT_CODES = ("Exit codes: 0 the run succeeded (or you quit the dashboard), 1 it failed, "
              "130 it was stopped, 2 bad input or no run reachable within --wait. "
              "ddtop export RUN --tensorboard DIR writes a run as TensorBoard files "
              "(ddtop export --help).")
DEFAULT_WAIT_S = 10.0
DEFAULT_FPS = 2.0  # redraws a second (nvitop: one every 2 s); each costs CPU (docs/performance.md)
MAX_FPS = 30.0  # more is not seen on a terminal, and each frame costs CPU the ranks could use
FIND_POLL_S = 0.2


# Every key the dashboard binds, as `ddtop --help` lists them: Textual's key names
# (as in a Binding), what they do. tests/test_app.py checks that they are exactly
# the keys of the app's, the ranks table's and the rank detail's BINDINGS.
KEYS = (("q", "quit (the run goes on)"), ("question_mark", "help"),
        ("s,S", "sort by the next column / reverse"), ("slash", "filter ranks"),
        ("escape", "clear the filter"), ("f", "problems only"), ("p", "pause"),
        ("w", "charts: the whole run / the newest 120 steps"),
        ("m", "rank map / ranks table (256 ranks or more; arrows move on the map)"),
        ("x", "stop the run (asks first)"), ("e", "gather the evidence now"),
        ("P", "profile the selected rank"),
        ("plus,equals_sign,minus", "replay faster / slower (--replay)"),
        ("up,down,k,j,pageup,pagedown,home,end", "move"), ("enter", "the rank's detail"))
DETAIL_KEYS = (("t", "its Python stacks"), ("l", "its log"),
               ("escape,enter,backspace", "back"), ("q", "quit"))
_SHOWN = {"question_mark": "?", "slash": "/", "escape": "Esc", "plus": "+", "equals_sign": "=",
          "minus": "-", "up": "Up", "down": "Down", "pageup": "PgUp", "pagedown": "PgDn",
          "home": "Home", "end": "End", "enter": "Enter", "backspace": "Backspace"}


def keys_line() -> str:
    """KEYS and DETAIL_KEYS in a sentence."""
    def said(keys: tuple[tuple[str, str], ...]) -> str:
        return ", ".join(f"{'/'.join(_SHOWN.get(k, k) for k in names.split(','))} {what}"
                         for names, what in keys)
    return f"{said(KEYS)}; in a rank's detail: {said(DETAIL_KEYS)}."


def build_parser() -> argparse.ArgumentParser:
    from ddtop.core.printer import add_output_arguments

    parser = OneLineParser(
        prog="ddtop",
        description="Live dashboard of a ddtrain run: every rank's progress, loss, throughput "
        f"and communication time, with stragglers, hangs and crashes named. Keys: {keys_line()}",
        epilog=EXIT_CODES,
    )
    parser.add_argument("run", nargs="?", metavar="RUN",
                        help="run id, unique prefix, or run directory (default: the newest "
                        "live run, else the newest run)")
    add_runs_dir_argument(parser)
    parser.add_argument("--connect", default=None, metavar="ENDPOINT",
                        help="attach to a daemon by its control endpoint (run.json's "
                             "endpoints.control: ipc://PATH, or tcp://HOST:PORT)")
    parser.add_argument("--replay", action="store_true",
                        help="play RUN's telemetry journal back instead of attaching live")
    parser.add_argument("--speed", type=float, default=None, metavar="X",
                        help="replay speed: X times real time, 0 for all at once "
                        "(default 1; with --headless 0)")
    parser.add_argument("--headless", action="store_true",
                        help="print progress lines instead of the dashboard (also when "
                        "there is no terminal)")
    add_output_arguments(parser)
    parser.add_argument("--serve", default=None, metavar="[HOST:]PORT",
                        help="serve the dashboard to a browser (textual-serve), on 127.0.0.1 "
                        "unless HOST is given; the link to open, with its token, is printed")
    parser.add_argument("--allow-stop", action="store_true",
                        help="with --serve: the page may stop the run (x); off by default")
    parser.add_argument("--no-stop", action="store_true",
                        help="x does not stop the run (what --serve's pages run)")
    parser.add_argument("--rank", type=int, default=None, metavar="N",
                        help="open rank N's detail at once (a page's #rank=N)")
    parser.add_argument("--view", choices=("table", "map"), default=None,
                        help="start on the ranks table or the rank map (default: the map "
                        "from 256 ranks; a page's #view=map)")
    parser.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="S",
                        help="seconds to wait for a run to appear and its daemon to answer "
                        f"(default {DEFAULT_WAIT_S:g})")
    parser.add_argument("--fps", type=float, default=DEFAULT_FPS, metavar="N",
                        help=f"dashboard redraws per second (default {DEFAULT_FPS:g}, at "
                        f"most {MAX_FPS:g})")
    return parser


def resolve(args: argparse.Namespace) -> RunPaths:
    """The run directory to watch: named, or the newest live run, else the newest
    run. Up to --wait seconds for it (or the runs folder) to appear and for its
    daemon to write run.json: a watcher started before its run (CI, a multi-node
    job's node 0) follows it. One line on stderr says that it waits."""
    runs_dir = Path(args.runs_dir or default_runs_dir())
    wait_s = 0.0 if args.replay else args.wait
    deadline = time.monotonic() + wait_s
    waiting = False

    def wait(what: str) -> None:
        nonlocal waiting
        if not waiting:
            print(f"ddtop: waiting up to {wait_s:g} s for {what} (--wait)", file=sys.stderr,
                  flush=True)
            waiting = True
        time.sleep(FIND_POLL_S)

    name = f"run {args.run!r}" if args.run else "a run"
    while True:
        try:
            paths = _find(runs_dir, args.run, late=time.monotonic() >= deadline)
        except NoSuchRun:
            if time.monotonic() < deadline:
                wait(f"{name} to appear under {runs_dir}/")
                continue
            if not waiting:
                raise
            fix = ("start it, or check the run id and --runs-dir" if args.run
                   else "start one, or pass --runs-dir")
            raise UsageError(f"no {name[2:] if args.run is None else name} appeared under "
                             f"{runs_dir}/ within {wait_s:g} s: {fix} (--wait S waits "
                             "longer)") from None
        # A run's folder is made before its daemon writes run.json: until then it
        # would look lost. Once there, the daemon's sockets are listening.
        if paths.status.exists() or time.monotonic() >= deadline:
            return paths
        wait(f"the daemon of run {paths.run_id} to start")


def _find(runs_dir: Path, run: str | None, late: bool) -> RunPaths:
    """RUN, or the newest live run; when no run is live but some exist (they are
    what there is), or once `late`, the newest run."""
    if run:
        return locate_run(runs_dir, run)
    runs = list_runs(runs_dir)
    live = [info for info in runs if info.live]
    if live:
        return live[-1].paths
    if runs or late:
        return find_run(runs_dir, None)  # the newest run, or the error that there is none
    raise NoSuchRun(f"no runs under {runs_dir}/: start one first, or pass --runs-dir")


def _resolve_run(args: argparse.Namespace) -> RunPaths:
    try:
        return resolve(args)
    except OSError as e:  # a RUN or --runs-dir the file system refuses
        raise UsageError(f"cannot look for runs there: {e.strerror or e}; "
                         "give a run id or a run directory") from None


def check(args: argparse.Namespace) -> None:
    from ddtop.core.printer import check_output_arguments

    problem = check_output_arguments(args)
    if problem is None and not 0 <= args.wait < math.inf:
        problem = f"--wait must be a number of seconds >= 0 (got {args.wait:g})"
    if problem is None and args.speed is not None and not 0 <= args.speed < math.inf:
        problem = f"--speed must be a number >= 0 (got {args.speed:g}); 0 replays at once"
    if problem is None and not 0 < args.fps <= MAX_FPS:
        problem = (f"--fps must be a number > 0 and at most {MAX_FPS:g} (got {args.fps:g}): a "
                   "terminal shows no more, and every frame costs CPU")
    if problem is None and args.connect is not None:
        if args.run or args.replay:
            problem = "--connect names the run itself: drop RUN and --replay"
        elif not (args.connect.startswith("ipc:///") or (
                args.connect.startswith("tcp://") and ":" in args.connect[6:])):
            problem = (f"--connect {args.connect!r}: expected tcp://HOST:PORT or ipc://PATH "
                       "(run.json's endpoints.control)")
    if problem is None and args.serve is not None and args.headless:
        problem = "--serve shows the dashboard in a browser: drop --headless"
    if problem is None and args.rank is not None and not 0 <= args.rank < MAX_JOB_RANKS:
        problem = f"--rank must be a rank number from 0 to {MAX_JOB_RANKS - 1} (got {args.rank})"
    if problem is None and args.headless and (args.rank is not None or args.view):
        problem = "--rank and --view open a view of the dashboard: drop --headless"
    if problem is None and args.allow_stop and args.serve is None:
        problem = "--allow-stop is for --serve's pages (a terminal's dashboard may stop its run)"
    if problem is not None:
        raise UsageError(problem)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:  # a command of its own (a run named export: give its folder)
        from ddtop.dashboard.export import main as export

        return export(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        check(args)
        from ddtop.dashboard.live import open_feed

        # textual-serve's sessions (--serve) have pipes, and Textual's web driver to draw on.
        headless = args.headless or not ((sys.stdout.isatty() and sys.stdin.isatty())
                                         or os.environ.get("TEXTUAL_DRIVER"))
        paths = None if args.connect is not None else _resolve_run(args)
        if args.serve is not None:
            from ddtop.dashboard.serve import serve

            return serve(args, paths)
        if paths is None:
            feed = open_feed(args.connect)
        else:
            speed = args.speed if args.speed is not None else (0.0 if headless else 1.0)
            feed = open_feed(paths, replay=args.replay, speed=speed)
    except UsageError as e:
        print(f"ddtop: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_USAGE
    if feed.note:
        print(f"ddtop: note: {feed.note}", file=sys.stderr)
    try:
        if headless:
            from ddtop.core.printer import Printer
            from ddtop.dashboard.headless import watch

            printer = Printer(args.format, args.interval, summary_json=args.summary_json)
            return watch(feed, printer, args.wait)
        from ddtop.dashboard.app import DashboardApp

        app = DashboardApp(feed, fps=args.fps, can_stop=not args.no_stop, rank=args.rank,
                           view=args.view)
        app.run()
        return app.exit_code
    finally:
        feed.close()


if __name__ == "__main__":
    sys.exit(main())
