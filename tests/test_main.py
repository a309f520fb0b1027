"""``python -m kfac_graph``: the registration table, then a short K-FAC run."""
import os
import subprocess
import sys
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _run(*flags):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-m", "kfac_graph", *flags], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)


# the default run (200 steps) is README's "main" sample: tests/test_readme.py


def test_main_train_steps_0_only_prints_the_table():
    result = _run("--train_steps=0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1,514 parameters" in result.stdout
    assert "training" not in result.stdout


def test_help_lists_the_flags(capsys):
    from tools import kfac_register

    assert kfac_register.main(["kfac-graph", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("saved_model", "function", "loss", "dot", "train_steps", "batch_size"):
        assert f"--{flag}:" in out


def test_bad_command_lines_fail_in_one_line(capsys):
    from tools import kfac_register

    for argv in (["--bogus"], ["extra"], ["--train_steps=-1"], ["--saved_model", "d"]):
        assert kfac_register.main(["kfac-graph", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("kfac-graph: error: ") and err.count("\n") == 1, err


def test_only_main_imports_tools():
    import ast

    for path in (ROOT / "kfac_graph").rglob("*.py"):
        if path.name == "__main__.py" and path.parent.name == "kfac_graph":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "tools" for n in names), path
