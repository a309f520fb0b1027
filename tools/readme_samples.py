"""README's sample outputs, regenerated from HEAD: check them or write them.

    python tools/readme_samples.py            # exit 1 and a diff if README disagrees
    python tools/readme_samples.py --write    # rewrite README's sample blocks

A sample is the fenced block right after a line ``<!-- sample: NAME -->`` in
README.md; ``SAMPLES[NAME]`` says how HEAD makes it. Lines are compared
exactly, except where a sample's ``drifting`` patterns match: there the
figures (which depend on the CPU's kernels, and on time) are masked and
only the words around them must agree. ``tests/test_readme.py`` runs the
check.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import pathlib
import re
import subprocess
import sys
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
_MARKER = re.compile(r"^<!-- sample: (\S+) -->$")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:e[-+]?\d+)?")


@dataclasses.dataclass(frozen=True)
class Sample:
    """How HEAD prints a sample, and the lines whose figures drift."""

    make: Callable[[str], str]  # the python block before the sample -> its output
    drifting: tuple = ()

    def masked(self, line: str) -> str:
        if any(re.search(p, line) for p in self.drifting):
            return _NUMBER.sub("#", line)
        return line


def _run(code_or_args, module=False) -> str:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", *code_or_args] if module else [sys.executable, "-c",
                                                                 code_or_args]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout


def main_sample(program: str) -> str:
    """``python -m kfac_graph``: the built-in CNN's table and 200 K-FAC steps."""
    return _run(["kfac_graph"], module=True).rstrip("\n")


_IMPORTS = "import keras, tensorflow as tf\nimport kfac_graph as kg\n"


def verify_sample(program: str, head: int = 4, tail: int = 3) -> str:
    """What README's ``kg.verify`` program (the python block before the
    sample) prints, trimmed: the first ``head`` and last ``tail`` layer rows,
    and one line for the columns' explanations."""
    lines = _run(_IMPORTS + program).rstrip("\n").splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("---")]
    top, bottom = rules[0], rules[1]
    rows = lines[top + 1:bottom]
    if len(rows) > head + tail:
        rows = rows[:head] + ["..."] + rows[-tail:]
    footer = lines[bottom:]
    explained = [i for i, line in enumerate(footer) if line.startswith("  ")]
    if explained:
        footer = (footer[:explained[0]] + ["  ... (a line per column saying what it compares)"]
                  + footer[explained[-1] + 1:])
    return "\n".join(lines[:top + 1] + rows + footer)


def program_sample(program: str) -> str:
    """What the python block before the sample prints, as it is."""
    return _run(_IMPORTS + program).rstrip("\n")


SAMPLES = {
    "main": Sample(main_sample, drifting=(r"^step ", r"^test accuracy")),
    "memory": Sample(program_sample),
    "privacy_statement": Sample(program_sample),
    "verify": Sample(verify_sample, drifting=(r" (ok|FAIL)$", r"^PASSED|^FAILED")),
}


def blocks(text: str) -> dict:
    """``{name: (first line, end line, program)}``: each sample block's body,
    as line indices into ``text.splitlines()`` (between its fences), and the
    body of the python block before its marker ("" if none)."""
    lines, out = text.splitlines(), {}
    for i, line in enumerate(lines):
        found = _MARKER.match(line)
        if found:
            if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
                raise ValueError(f"README: sample {found.group(1)} is not followed by a fence")
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            out[found.group(1)] = (i + 2, end, _program_before(lines, i))
    return out


def _program_before(lines, marker) -> str:
    """The ```python block ending just above line ``marker`` (blank lines between)."""
    j = marker - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    if j < 0 or lines[j] != "```":
        return ""
    start = max((k for k in range(j) if lines[k] == "```python"), default=None)
    return "" if start is None else "\n".join(lines[start + 1:j]) + "\n"


def differences(name: str, written: str, printed: str) -> list[str]:
    """The unified diff of the masked lines (empty when they agree)."""
    sample = SAMPLES[name]
    a = [sample.masked(line) for line in written.splitlines()]
    b = [sample.masked(line) for line in printed.splitlines()]
    return list(difflib.unified_diff(a, b, f"README {name}", f"HEAD {name}", lineterm=""))


def check(names=None) -> dict:
    """``{name: diff lines}`` for every sample (or ``names``) README gets wrong."""
    text = README.read_text(encoding="utf-8")
    lines, found = text.splitlines(), blocks(text)
    wrong = {}
    for name in names or SAMPLES:
        if name not in found:
            wrong[name] = [f"README has no sample {name!r}"]
            continue
        first, end, program = found[name]
        diff = differences(name, "\n".join(lines[first:end]), SAMPLES[name].make(program))
        if diff:
            wrong[name] = diff
    return wrong


def write(names=None) -> None:
    """Replaces the sample blocks with what HEAD prints (all or nothing)."""
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    found = blocks(text)
    for name in sorted(names or SAMPLES, key=lambda n: -found[n][0]):  # bottom up
        first, end, program = found[name]
        lines[first:end] = SAMPLES[name].make(program).splitlines()
    tmp = README.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, README)


def main(argv: list[str]) -> int:
    names = [a for a in argv[1:] if not a.startswith("--")] or None
    if "--write" in argv:
        write(names)
        return 0
    wrong = check(names)
    for name, diff in wrong.items():
        print(f"README sample {name!r} is not what HEAD prints:\n" + "\n".join(diff))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
