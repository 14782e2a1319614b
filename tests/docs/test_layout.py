"""How the tree's Python is laid out (issue #29): modules find each other as
packages, never by editing sys.path; latency_bench is one package with one
entry point, `python -m latency_bench COMMAND`, whose commands the docs name
exactly."""

import ast
import contextlib
import io
import re
import subprocess
import sys

from latency_bench.__main__ import COMMANDS, main
from latency_bench.harness import ROOT

MUTATORS = {"insert", "append", "extend", "remove", "pop", "clear", "__setitem__", "__iadd__"}
TEXT_EDIT = re.compile(r"\bsys\.path\s*(\.\s*(insert|append|extend)\b|(\[[^]]*\])?\s*\+?=[^=])|addsitedir\(")
DOCS = ["README.md", "BENCHMARKS.md", "RELIABILITY.md", "latency_bench/README.md", "docs/*.md",
        "latency_bench/*.py", "tests/*.py", ".ci/*"]


def tracked(*patterns: str) -> list:
    files = subprocess.run(["git", "ls-files", "-z", "--", *patterns], cwd=ROOT, capture_output=True, check=True)
    return [ROOT / name for name in files.stdout.decode().split("\0") if name and (ROOT / name).is_file()]


def is_sys_path(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def sys_path_edits(source: str) -> list[int]:
    """Lines that change sys.path: a mutating call on it, an assignment to it
    or to a slice of it, `+=`, `from sys import path` (then edited unseen),
    site.addsitedir. A file that does not parse (examples/ holds unfinished
    code to complete) is read line by line."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return [n for n, line in enumerate(source.splitlines(), 1) if TEXT_EDIT.search(line)]
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if (node.func.attr in MUTATORS and is_sys_path(node.func.value)) or node.func.attr == "addsitedir":
                lines.append(node.lineno)
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if is_sys_path(target) or (isinstance(target, ast.Subscript) and is_sys_path(target.value)):
                lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            lines.append(node.lineno)
    return lines


def test_no_python_file_edits_sys_path():
    files = tracked("*.py")
    assert len(files) > 100 and ROOT / "latency_bench" / "harness.py" in files
    edits = [f"{path.relative_to(ROOT)}:{line}" for path in files for line in sys_path_edits(path.read_text())]
    assert not edits, f"import through packages (latency_bench.*, completer.*) instead of editing sys.path: {edits}"


def test_the_sys_path_check_sees_each_kind_of_edit():
    for edit in ("sys.path.insert(0, 'x')", "sys.path.append(p)", "sys.path[:0] = [p]", "sys.path = [p]",
                 "sys.path += [p]", "from sys import path", "site.addsitedir(p)"):
        assert sys_path_edits(f"import sys, site\n{edit}\n") == [2], edit
    assert sys_path_edits("import sys\nprint(sys.path[0], list(sys.path))\n") == []
    for edit in ("sys.path.insert(0, 'x')", "sys.path.append(p)", "sys.path[:0] = [p]", "sys.path += [p]"):
        assert sys_path_edits(f"def unfinished(:\n{edit}\n") == [2], edit
    assert sys_path_edits("def unfinished(:\nif sys.path == p: print(sys.path[0])\n") == []


def help_text() -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--help"]) == 0
    return out.getvalue()


def test_every_command_has_a_module_with_a_main_and_a_line_in_the_help():
    text = help_text()
    for command, (module, line) in COMMANDS.items():
        path = ROOT / "latency_bench" / f"{module}.py"
        mains = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        assert mains, f"{path.relative_to(ROOT)} has no main() for `python -m latency_bench {command}`"
        assert re.search(rf"^  {re.escape(command)} +{re.escape(line)}$", text, re.M), (command, text)
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main(["no-such-command"]) == 2
    assert "no command 'no-such-command'" in err.getvalue()


def test_the_readme_lists_every_command_and_every_module_and_the_docs_name_only_real_commands():
    readme = (ROOT / "latency_bench" / "README.md").read_text()
    missing = [c for c in COMMANDS if f"`python -m latency_bench {c}" not in readme]
    assert not missing, f"latency_bench/README.md has no row for: {missing}"
    commands = {module for module, _ in COMMANDS.values()}
    shared = sorted(p.name for p in (ROOT / "latency_bench").glob("*.py")
                    if not p.name.startswith("__") and p.stem not in commands)
    assert "harness.py" in shared
    unnamed = [name for name in shared if f"`{name}`" not in readme]
    assert not unnamed, f"latency_bench/README.md's shared pieces do not name: {unnamed}"
    wrong = sorted({f"{path.relative_to(ROOT)}: {name}" for path in tracked(*DOCS)
                    for name in re.findall(r"python -m latency_bench ([\w-]+)", path.read_text())
                    if name not in COMMANDS and name != "COMMAND" and not name.startswith("-")})
    assert not wrong, f"commands that `python -m latency_bench` does not have: {wrong}"


def test_a_command_runs_through_the_entry_point_from_the_root():
    done = subprocess.run([sys.executable, "-m", "latency_bench", "llama-peer", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m latency_bench llama-peer"), done.stdout
    assert "build" in done.stdout and "gguf" in done.stdout
