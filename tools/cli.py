"""What the command-line tools share: flags on a ``FlagValues`` of their
own (so ``--help`` lists exactly them), and every failure reported as one
line ``PROG: error: ...`` with exit status 2.

    def main(argv):
        return cli.main(argv, PROG, __doc__, define_flags, run)
"""
from __future__ import annotations

import os
import sys
from typing import Callable

from absl import flags


class UsageError(Exception):
    """A bad command line (reported like any other bad input)."""


def main(argv: list[str], prog: str, doc: str,
         define_flags: Callable[[flags.FlagValues], flags.FlagValues],
         run: Callable[[flags.FlagValues], int]) -> int:
    """Parses ``argv`` (``argv[0]`` is the program) into fresh flags, runs
    ``run(flags)`` and returns the exit status; ``--help`` prints ``doc`` and
    the flags."""
    fv = define_flags(flags.FlagValues())
    if any(a in ("-h", "--help", "-help", "--helpfull") for a in argv[1:]):
        print(doc.strip() + "\n\nflags:\n" + fv.get_help())
        return 0
    try:
        rest = fv(argv)
        if len(rest) > 1:
            raise UsageError(f"unexpected arguments: {' '.join(rest[1:])}")
        return run(fv)
    except flags.Error as e:
        return fail(prog, str(e).splitlines()[0])
    except UsageError as e:
        return fail(prog, str(e))
    except Exception as e:  # noqa: BLE001 - every failure is reported in one line
        import kfac_graph as kg

        if isinstance(e, kg.LossNotFoundError):
            return fail(prog, f"{e.args[0].split('; name it')[0]}; name its kind with "
                        "--loss=categorical|bernoulli|normal")
        if isinstance(e, kg.KfacGraphError):
            return fail(prog, str(e))
        raise


class NumberParser(flags.ArgumentParser):
    """A number flag that keeps text it cannot read as a number (``'abc'``):
    the tool checks every value against the option's range itself and names
    the flag in the one-line error (``--damping must be ..., got 'abc'``), one
    wording for a bad number and a bad range. ``integer``: read ``"3"`` as 3
    (``"2.5"`` stays a float, for the check to refuse)."""

    def __init__(self, integer: bool = False):
        self.integer = integer
        self.syntactic_help = "an integer" if integer else "a number"

    def parse(self, argument):
        if not isinstance(argument, str):
            return argument
        for convert in ((int, float) if self.integer else (float,)):
            try:
                return convert(argument)
            except ValueError:
                pass
        return argument

    def flag_type(self) -> str:
        return "int" if self.integer else "float"


def define_number(name: str, integer: bool, text: str, fv: flags.FlagValues) -> None:
    """Defines the number flag ``name`` (default None) with a ``NumberParser``."""
    flags.DEFINE(NumberParser(integer), name, None, text, flag_values=fv)


def fail(prog: str, message: str) -> int:
    """Prints ``PROG: error: message`` to stderr; the exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def check_writable(path: str) -> None:
    """Raises ``UsageError`` unless ``path``'s folder exists and is writable."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write {path}: {parent} is not a writable directory")
