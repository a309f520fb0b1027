"""``python -m kfac_graph``: the registration table, then a short K-FAC run."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


# the default run (200 steps) is README's "main" sample: tests/test_readme.py


def test_main_train_steps_0_only_prints_the_table(capsys):
    """In process (``python -m kfac_graph`` itself runs in a fresh process in
    test_readme.py's main sample, which prints this table before training)."""
    from tools import kfac_register

    assert kfac_register.main(["kfac-graph", "--train_steps=0"]) == 0
    out = capsys.readouterr().out
    assert "1,514 parameters" in out
    assert "training" not in out


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
