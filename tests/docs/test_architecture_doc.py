"""docs/architecture.md matches the code: every module it names exists, and
every module is named; its config sections are the config's and its commands
the CLI's. README's Layout is checked against the tree and against it
(issue #47: docs drift)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def named_modules() -> set[Path]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    out = set()
    for name in re.findall(r"`([\w/]+\.py)`", text):
        top = name.split("/")[0]
        out.add(ROOT / name if top in ("kernels", "latency_bench") else ROOT / "completer" / name)
    return out


def test_every_module_named_exists_and_every_module_is_named():
    named = named_modules()
    missing = sorted(str(p.relative_to(ROOT)) for p in named if not p.exists())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
    modules = {p for d in ("completer", "kernels", "latency_bench") for p in (ROOT / d).rglob("*.py")
               if p.name != "__init__.py"}
    unnamed = sorted(str(p.relative_to(ROOT)) for p in modules - named)
    assert not unnamed, f"modules docs/architecture.md does not name: {unnamed}"


def assignments(attr: str, in_tuples: bool = True) -> set[str]:
    """`path:line` of every assignment to an attribute named `attr` in
    completer/ (plain, annotated, augmented, and with `in_tuples` inside tuple targets)."""
    import ast

    out = set()
    for path in (ROOT / "completer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            flat = [t for target in targets
                    for t in (target.elts if in_tuples and isinstance(target, ast.Tuple) else [target])]
            if any(isinstance(t, ast.Attribute) and t.attr == attr for t in flat):
                out.add(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_only_the_scheduler_changes_a_requests_status():
    """vLLM v1's step contract: the scheduler alone moves a request between
    waiting, prefill, remote, decode and finished; the core, candidates and
    disaggregation ask it to (a status written elsewhere is a second owner)."""
    writers = assignments("status", in_tuples=False)  # (an HTTP error's `status` is set in a tuple)
    files = {w.split(":")[0] for w in writers}
    assert files == {"completer/engine/scheduler.py", "completer/engine/sequence.py"}, sorted(writers)
    # sequence.py only sets the initial WAITING
    assert sum(w.startswith("completer/engine/sequence.py") for w in writers) == 1


def test_kv_progress_is_written_in_one_module():
    """A sequence's K/V progress (`CacheState.computed`) moves in
    kv_cache_manager.py alone (sequence.py starts it at 0): the runner
    returns logits, and the step's update advances, publishes and rolls back."""
    writers = assignments("computed")
    files = {w.split(":")[0] for w in writers}
    assert files == {"completer/engine/kv_cache_manager.py", "completer/engine/sequence.py"}, sorted(writers)
    assert sum(w.startswith("completer/engine/sequence.py") for w in writers) == 1


def test_live_requests_have_one_registry_the_schedulers():
    """One registry of live requests: no other attribute maps ids (of
    requests or jobs) to sequences or candidate groups."""
    import ast

    registries = set()
    for path in (ROOT / "completer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute) and \
                    re.fullmatch(r"dict\[.*, (Sequence|CandidateGroup)\]", ast.unparse(node.annotation)):
                registries.add(f"{path.relative_to(ROOT)}:{node.target.attr}")
    assert registries == {"completer/engine/scheduler.py:requests"}


def test_the_step_reads_as_plan_run_update():
    """EngineCore._step: the scheduler's plan, the executor's passes, and
    `update` applying each output; no pass is run, nor K/V touched, in core.py."""
    import ast

    source = (ROOT / "completer" / "engine" / "core.py").read_text()
    step = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "_step")
    calls = [ast.unparse(n.func) for n in ast.walk(step) if isinstance(n, ast.Call)]
    assert "self.scheduler.schedule" in calls
    assert {"self.executor.prefill", "self.executor.decode"} <= set(calls)
    assert calls.count("self.update") >= 2
    assert not re.search(r"\.execute\(|\.start\(\[|kv\.(allocate|rollback|publish|grow)\(", source)


def calls_of(pattern: str) -> set[str]:
    """`path:line` of every call in completer/ whose callee reads as `pattern` (a regex)."""
    import ast

    out = set()
    for path in (ROOT / "completer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and re.fullmatch(pattern, ast.unparse(node.func)):
                out.add(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_the_plan_allocates_every_block_a_step_writes():
    """Blocks are taken for a step in `Scheduler.schedule` alone (vLLM v1's
    `allocate_slots` with its lookahead): prefill chunks, moved copies, and
    each decoding sequence's verify step and drafts (`grow_ahead`); the
    executor and the drafter only check that their rows have blocks. (Outside
    the step: admission's prefix match, and a connector's job destination,
    which the scheduler's admission asks for. Calibration's timed dummy and a
    prefill worker hold pools of their own.)"""
    growers = {w.split(":")[0] for w in calls_of(r"(self\.)?kv\.(grow|grow_ahead|moved_slots|admit)")}
    assert growers == {"completer/engine/scheduler.py", "completer/disagg/connector.py"}, sorted(growers)
    checks = {w.split(":")[0] for w in calls_of(r".*\.check_room")}
    assert checks == {"completer/engine/executor.py", "completer/engine/proposers.py"}, sorted(checks)


def test_candidates_join_running_through_the_plan():
    """A request's candidates are asked for in the update (`Scheduler.fork`)
    and join running in `schedule`, which lists them (`SchedulerOutput.forks`);
    only the scheduler adds to its queues."""
    import ast

    from completer.engine.scheduler import SchedulerOutput

    assert "forks" in SchedulerOutput._fields
    adders = set()
    for path in (ROOT / "completer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and re.fullmatch(r".*\b(running|waiting)\.(append|insert|extend)",
                                                           ast.unparse(node.func)):
                adders.add(str(path.relative_to(ROOT)))
    assert adders == {"completer/engine/scheduler.py"}, sorted(adders)


# -- README's Layout, checked against the tree and docs/architecture.md ------------------------------

LAYOUT_ENTRY = re.compile(r"^( {0,2})(\S.*?)(?: {2,}(.*))?$")


def layout() -> dict[str, str]:
    """README's Layout block as {path named: the text of its entry}. A line
    indented 0 or 2 spaces starts an entry (2: inside `completer/`); its
    names are the first column, several separated by ", "; a line indented
    further goes on the entry's text."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^## Layout\n+```\n(.*?)^```", text, re.S | re.M).group(1)
    entries: dict[str, str] = {}
    names: list[str] = []
    for line in block.splitlines():
        m = LAYOUT_ENTRY.match(line)
        if not m or len(line) - len(line.lstrip()) > 2:
            for name in names:
                entries[name] += " " + line.strip()
            continue
        parent = "completer/" if m.group(1) else ""
        names = [parent + n.strip() for n in m.group(2).split(",")]
        for name in names:
            entries[name] = m.group(3) or ""
    return entries


def diagram_modules() -> set[str]:
    """The modules docs/architecture.md's overview diagram (its first block)
    names, as paths under completer/: `server/session`, `pipeline`, and
    engine/core's parts by their bare names (`scheduler`: engine/scheduler.py)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    diagram = re.search(r"^```\n(.*?)^```", text, re.S | re.M).group(1)
    out = set()
    for word in re.findall(r"[a-z_]+(?:/[a-z_]+)*", diagram):
        for module in (f"{word}.py", f"engine/{word}.py"):
            if (ROOT / "completer" / module).is_file():
                out.add(module)
                break
    return out


def test_the_readme_layout_names_what_exists_and_what_matters():
    """What README's Layout must hold (keep it short: folders and the main
    modules; docs/architecture.md has every module):
    - every file and folder it names exists;
    - every top-level folder of the repository (tracked, not hidden) is an entry;
    - every folder of completer/ (its direct subfolders and every package
      below them) is an entry, or, nested, named as `name/` in its parent's entry;
    - every top-level module of completer/ is an entry (`a.py, b.py` may share one);
    - every module docs/architecture.md's overview diagram names is an entry
      or, in a subpackage, named in its folder's entry (`service` in `server/`'s);
    - every module it names is one docs/architecture.md names too."""
    entries = layout()
    missing = sorted(name for name in entries if not (ROOT / name.rstrip("/")).exists())
    assert not missing, f"README's Layout names what does not exist: {missing}"

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top = {f"{line.split('/')[0]}/" for line in tracked.splitlines() if "/" in line and not line.startswith(".")}
    assert not top - set(entries), f"top-level folders README's Layout does not list: {sorted(top - set(entries))}"

    package = ROOT / "completer"
    folders = {p for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"}
    folders |= {p.parent for p in package.rglob("*/__init__.py")}
    unlisted = []
    for folder in sorted(folders):
        name = f"{folder.relative_to(ROOT)}/"
        parent = f"{folder.parent.relative_to(ROOT)}/"
        if name not in entries and f"{folder.name}/" not in entries.get(parent, ""):
            unlisted.append(name)
    assert not unlisted, f"folders of completer/ README's Layout does not list: {unlisted}"

    modules = {f"completer/{p.name}" for p in package.glob("*.py") if p.name != "__init__.py"}
    assert not modules - set(entries), f"modules README's Layout does not list: {sorted(modules - set(entries))}"

    absent = []
    for module in sorted(diagram_modules()):
        folder, _, stem = module.removesuffix(".py").rpartition("/")
        if f"completer/{module}" not in entries and not re.search(
                rf"\b{stem}\b", entries.get(f"completer/{folder}/", "")):
            absent.append(module)
    assert not absent, f"modules of docs/architecture.md's diagram README's Layout does not name: {absent}"

    named = {str(p.relative_to(ROOT)) for p in named_modules()}
    unknown = sorted(n for n in entries if n.endswith(".py") and n not in named and not n.startswith("examples"))
    assert not unknown, f"modules README's Layout names that docs/architecture.md does not: {unknown}"


def test_the_layout_check_fails_on_a_missing_folder(monkeypatch):
    entries = layout()
    assert {"completer/disagg/", "completer/cluster/", "completer/retrieval.py"} <= set(entries)
    assert "service" in entries["completer/server/"] and "compat/" in entries["completer/server/"]
    assert {"server/service.py", "engine/core.py", "engine/scheduler.py", "pipeline.py"} <= diagram_modules()
    monkeypatch.setattr(sys.modules[__name__], "layout", lambda: {k: v for k, v in entries.items()
                                                                   if k != "completer/disagg/"})
    with pytest.raises(AssertionError, match="completer/disagg/"):
        test_the_readme_layout_names_what_exists_and_what_matters()


# -- docs/architecture.md's config sections ------------------------------------------------------------

def test_the_config_sections_architecture_md_lists_are_the_configs():
    """`config/__init__.py`'s entry lists the TOML sections: those of configs/default.toml
    and of the config's schema (`completer.config.SECTIONS`), in that order."""
    import tomllib

    from completer.config import SECTIONS

    text = (ROOT / "docs" / "architecture.md").read_text()
    entry = re.search(r"^- `config/__init__\.py`: (.*?)(?=^- |^#|\Z)", text, re.S | re.M).group(1)
    listed = re.findall(r"`\[(\w+)\]`", entry)
    default = list(tomllib.loads((ROOT / "configs" / "default.toml").read_text()))
    assert default == list(SECTIONS), "configs/default.toml's sections are not the schema's"
    assert listed == default, f"docs/architecture.md's config/__init__.py lists {listed}; the config has {default}"


def test_the_commands_architecture_md_lists_are_the_clis():
    import argparse

    from completer.cli import build_parser

    text = (ROOT / "docs" / "architecture.md").read_text()
    listed = re.search(r"^- `cli\.py`: `completer ([^`]*)`", text, re.M).group(1).split(" | ")
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(listed) == sorted(sub.choices), f"docs/architecture.md's cli.py lists {listed}"
