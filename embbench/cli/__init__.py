"""``embbench``: the command line. Each subcommand is a module of this package holding its
arguments (``register``) and what it does (``main``, or one function per sub-subcommand);
:mod:`embbench.cli.shared` holds what they share.

``embbench run | strategies | show | compare | report | recommend | project | curve | disk |
data check | data prepare | data import-tbe | trace record | trace import-dlrm``."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from embbench.cli import compare, curve, data, disk, project, recommend, report, run, show, strategies, trace
from embbench.cli.run import EXIT_CELLS_FAILED, EXIT_NOTHING_RAN
from embbench.cli.shared import console
from embbench.optional import MissingDependency
from embbench.results import RecordError
from embbench.scenario import ScenarioError

__all__ = ["EXIT_CELLS_FAILED", "EXIT_NOTHING_RAN", "build_parser", "console", "main"]

#: The subcommands in the order ``embbench --help`` lists them.
COMMANDS = (run, data, trace, strategies, show, curve, disk, recommend, compare, report, project)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="embbench", description="Benchmark embedding-table placement strategies.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: the cell's processes are killed, records kept


def _stdout_gone() -> int:
    """``| head`` closed the pipe: the reader has what it wanted, so nothing is said (as a
    command killed by SIGPIPE says nothing); nothing more goes to the closed pipe (not even at
    exit, where Python flushes stdout)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, as a shell reports a command killed by a closed pipe


def main(argv: list[str] | None = None) -> int:
    """The command; ``argv`` None: this process's own command line, whose exit follows."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # another Ctrl-C while the first unwinds (its message, the handlers' reset): said once
        return 130
    finally:
        if argv is None:  # the command is done: a Ctrl-C during the interpreter's exit ends it quietly
            signal.signal(signal.SIGINT, _exit_now)


def exit_process(code: int) -> None:
    """End this process with ``code`` (``python -m embbench``). In a torchrun rank, once Python's
    exit functions have run (finalizers, flushed streams), the interpreter's teardown is skipped:
    torch's C++ threads (the rendezvous store's, gloo's) were seen aborting a rank there
    ("terminate called without an active exception", SIGABRT) after every record was written,
    which failed the whole job."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _exit_now(signum, frame):
    os._exit(130)  # no traceback from inside the interpreter's exit (threads joined, atexit handlers)


def _main(argv: list[str] | None) -> int:
    previous = signal.signal(signal.SIGTERM, _interrupt)  # before the arguments: `--iops measured:` measures as it parses
    try:
        args = build_parser().parse_args(argv)
        if sys.stdout is None:  # started with stdout closed (>&-): there is nowhere to print to
            print(f"error: standard output is closed; embbench {args.command} prints its results there "
                  "(redirect it to a file or /dev/null instead)", file=sys.stderr)
            return 2
        return args.func(args)
    except BrokenPipeError:
        return _stdout_gone()
    except (ScenarioError, RecordError, ValueError, OSError, MissingDependency) as e:  # OSError names its file
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
