"""Context kinds, per-workspace candidates, and the server-side import
resolver with its exclusion rules (completer/workspace.py): unit checks of
what it opens, then the real server, where nothing excluded may reach the
prompt (seen in `prompt_tokens`: the prompt with the workspace is exactly the
prompt with only the allowed file sent by hand)."""

from __future__ import annotations

import json
import os
from pathlib import Path, PurePosixPath

import pytest

import completer.workspace as workspace_module
from completer.config import ConfigError, load_config
from completer.protocol import Document, Error, decode
from completer.retrieval import Retriever
from completer.prompt import Snippet
from completer.workspace import WorkspaceFiles, import_statements

QUERY = "def bill(invoice):\n    amount = invoice.total_amount()\n    for line in invoice.lines:\n" \
        "        cost = line.price * line.quantity\n"
IMPORTS = "from app import models, env, credentials, generated, outside, big, missing\nimport os\n"
MODELS = "class Invoice:\n    def total_amount(self):\n        return sum(l.price * l.quantity for l in self.lines)\n"
# Each excluded file shares the query's names, so retrieval would place it if it were ever read.
SECRETS = {
    ".env": "ENV_MARKER_TOKEN = 'hunter2'  # invoice total_amount lines price quantity env_only\n",
    "app/credentials.py": "CREDENTIALS_MARKER = 'aws-key'  # invoice total_amount lines price quantity cred_only\n",
    "app/generated.py": "GENERATED_MARKER = 1  # invoice total_amount lines price quantity gen_only\n",
    "app/big.py": "BIG_MARKER = 1  # invoice total_amount lines price quantity big_only\n" + "#" * 3000 + "\n",
}
OUTSIDE = "OUTSIDE_MARKER = 'etc'  # invoice total_amount lines price quantity outside_only\n"
MARKERS = ("ENV_MARKER", "CREDENTIALS_MARKER", "GENERATED_MARKER", "BIG_MARKER", "OUTSIDE_MARKER")


def make_workspace(base: Path) -> Path:
    """base/allowed/proj: an allowed module, and next to it a .env (imported
    through a symlink `env.py`), a secret, a gitignored module, a big one, and
    a symlink out of the workspace."""
    ws = base / "allowed" / "proj"
    (ws / "app").mkdir(parents=True)
    (ws / "app" / "__init__.py").write_text("")
    (ws / "app" / "models.py").write_text(MODELS)
    for path, text in SECRETS.items():
        (ws / path).write_text(text)
    (ws / ".gitignore").write_text("# build output\napp/generated.py\n")
    (ws / "app" / "env.py").symlink_to(ws / ".env")
    (base / "outside.py").write_text(OUTSIDE)
    (ws / "app" / "outside.py").symlink_to(base / "outside.py")
    return ws


def document(ws: Path, prefix: str = IMPORTS + QUERY) -> Document:
    return Document((ws / "app" / "billing.py").as_uri(), prefix, "\n", "python")


def test_only_the_allowed_import_is_opened_and_read(tmp_path, monkeypatch):
    ws = make_workspace(tmp_path)
    opened = []
    real_open = os.open
    monkeypatch.setattr(workspace_module, "_open", lambda path, *a: opened.append(Path(path)) or real_open(path, *a))
    files = WorkspaceFiles([str(tmp_path / "allowed")], max_file_bytes=2000)
    items = files.imported(ws.as_uri(), document(ws))
    assert [(PurePosixPath(i.uri).name, i.text, i.kind) for i in items] == [("models.py", MODELS, "definition")]
    # Only .gitignore files are opened besides it (to learn what they ignore); big.py is opened, found too
    # big by fstat and never read; no excluded path is opened at all.
    assert set(opened) - {ws / "app" / "models.py", ws / "app" / "big.py", ws / "app" / "__init__.py"} \
        == {ws / ".gitignore"}
    assert not {tmp_path / "outside.py", ws / ".env", ws / "app" / "credentials.py",
                ws / "app" / "generated.py"} & set(opened)


def test_nothing_is_read_outside_the_allowed_roots_or_when_none_are(tmp_path, monkeypatch):
    ws = make_workspace(tmp_path)
    monkeypatch.setattr(workspace_module, "_open", lambda *a: pytest.fail(f"opened {a[0]}"))
    assert WorkspaceFiles([], 10_000).imported(ws.as_uri(), document(ws)) == []
    (tmp_path / "other").mkdir()
    files = WorkspaceFiles([str(tmp_path / "other")], 10_000)
    assert files.imported(ws.as_uri(), document(ws)) == []
    files = WorkspaceFiles([str(ws / "app")], 10_000)  # a root inside the workspace does not allow all of it
    assert files.imported(ws.as_uri(), document(ws)) == []
    escaping = (tmp_path / "other").as_uri() + "/../allowed/proj"  # `..` resolved before the check
    assert WorkspaceFiles([str(tmp_path / "other")], 10_000).imported(escaping, document(ws)) == []
    assert files.imported("https://example.com/proj", document(ws)) == []


def test_imports_are_read_from_a_document_that_does_not_parse():
    text = "import a.b\nfrom .c import (d,\n    e)\ndef broken(:\n    from f import g\nfrom h import\n"
    assert import_statements(text).split("\n") == ["import a.b", "from .c import (d,", "e)", "from f import g"]


def test_a_gitignore_negation_and_nested_gitignores_follow_gits_rules(tmp_path):
    ws = tmp_path / "ws"
    (ws / "pkg" / "sub").mkdir(parents=True)
    (ws / ".gitignore").write_text("pkg/*.py\n!pkg/keep.py\n")
    (ws / "pkg" / "sub" / ".gitignore").write_text("local.py\n")
    files = WorkspaceFiles([str(tmp_path)], 10_000)
    assert files.ignored(ws, PurePosixPath("pkg/drop.py")) and not files.ignored(ws, PurePosixPath("pkg/keep.py"))
    assert files.ignored(ws, PurePosixPath("pkg/sub/local.py"))
    assert not files.ignored(ws, PurePosixPath("pkg/sub/other.py"))


def test_a_bad_workspace_root_stops_the_start_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"server.workspace_roots\[0\] = 'relative/dir'"):
        load_config(None, ['server.workspace_roots=["relative/dir"]'])
    with pytest.raises(ConfigError, match="server.workspace_roots"):
        load_config(None, [f'server.workspace_roots=["{tmp_path / "missing"}"]'])
    assert load_config(None, [f'server.workspace_roots=["{tmp_path}"]']).server.workspace_roots == [str(tmp_path)]


def test_an_unknown_kind_is_refused_naming_the_field():
    frame = {"type": "complete", "id": "7", "document": {"uri": "a.py", "prefix": "", "suffix": ""},
             "context": [{"uri": "b.py", "text": "x"}, {"uri": "c.py", "text": "y", "kind": "bogus"}]}
    answer = decode(json.dumps(frame))
    assert isinstance(answer, Error) and answer.id == "7" and answer.code == "bad_request"
    assert "$.context[1].kind" in answer.message
    frame["context"][1]["kind"] = "definition"
    assert decode(json.dumps({**frame, "workspace": "file:///w"})).context[1].kind == "definition"


def test_a_definition_ranks_ahead_of_an_open_buffer_on_a_tie():
    text = "def total_amount(invoice):\n    return invoice.price\n"
    r = Retriever(lambda s: len(s.text.split()), budget=8)  # room for one window
    chosen = r.select("invoice.total_amount()", [Snippet("a/open.py", text, "open"),
                                                 Snippet("a/defs.py", text, "definition")])
    assert [c.uri for c in chosen] == ["a/defs.py"]
    chosen = Retriever(lambda s: len(s.text.split()), budget=8).select(
        "invoice.total_amount()", [Snippet("a/open.py", text, "open"), Snippet("a/defs.py", text, "")])
    assert [c.uri for c in chosen] == ["a/open.py"]  # without the prior: the first of the tie


# -- the real server --------------------------------------------------------------


async def test_excluded_files_never_reach_the_prompt_on_the_real_server(tmp_path):
    from latency_bench.harness import collect, connect, running_server

    ws = make_workspace(tmp_path)
    doc = document(ws)

    async def prompt_tokens(**fields) -> int:
        async with connect(server) as conn:  # a fresh connection each: nothing stored from before
            await conn.send(json.dumps({"type": "complete", "id": "1", "max_tokens": 1, **fields,
                                        "document": {"uri": doc.uri, "language": "python",
                                                     "prefix": doc.prefix, "suffix": doc.suffix}}))
            _, done = await collect(conn, "1")
            assert done["type"] == "done", done
            return done["timings"]["prompt_tokens"]

    allowed = tmp_path / "allowed"
    with running_server(f'server.workspace_roots=["{allowed}"]', "server.workspace_file_bytes=2000") as server:
        alone = await prompt_tokens()
        by_hand = await prompt_tokens(context=[{"uri": (ws / "app" / "models.py").as_uri(), "text": MODELS,
                                                "kind": "definition"}])
        resolved = await prompt_tokens(workspace=ws.as_uri())
        assert by_hand > alone + 10  # models.py's window is in the prompt
        assert resolved == by_hand  # ... and nothing else the document imports
        # A workspace outside the allowed root, or reached by `..` out of it, is not read (it holds app/models.py).
        (tmp_path / "elsewhere" / "app").mkdir(parents=True)
        (tmp_path / "elsewhere" / "app" / "models.py").write_text(MODELS)
        assert await prompt_tokens(workspace=(tmp_path / "elsewhere").as_uri()) == alone
        assert await prompt_tokens(workspace=allowed.as_uri() + "/../elsewhere") == alone
        assert await prompt_tokens(workspace=allowed.as_uri() + "/../elsewhere/../allowed/proj") == resolved
        # The control: the rules are what kept them out. Without the .gitignore, generated.py is read.
        (ws / ".gitignore").unlink()
        assert await prompt_tokens(workspace=ws.as_uri()) > resolved


async def test_a_file_of_one_workspace_is_never_a_candidate_in_another_on_the_real_server():
    from latency_bench.harness import collect, complete_msg, connect, running_server

    with running_server() as server:
        async with connect(server) as ws:
            async def prompt_tokens(rid: str, uri: str, prefix: str, **fields) -> int:
                await ws.send(complete_msg(rid, prefix, uri=uri, max_tokens=1, **fields))
                _, done = await collect(ws, rid)
                assert done["type"] == "done", done
                return done["timings"]["prompt_tokens"]

            a, b = "file:///work/a", "file:///work/b"
            alone = await prompt_tokens("1", "file:///work/b/billing.py", QUERY, workspace=b)
            await prompt_tokens("2", "file:///work/a/models.py", MODELS, workspace=a)
            # The same document name in workspace b: models.py (workspace a) is not placed.
            assert await prompt_tokens("3", "file:///work/b/billing.py", QUERY, workspace=b) == alone
            assert await prompt_tokens("4", "file:///work/b/billing.py", QUERY, workspace=a) > alone + 10
            # A bad kind is answered with an error naming the field, and the connection goes on.
            await ws.send(complete_msg("5", QUERY, context=[{"uri": "x.py", "text": "y", "kind": "nope"}]))
            _, error = await collect(ws, "5")
            assert error["code"] == "bad_request" and "context[0].kind" in error["message"], error
            assert await prompt_tokens("6", "file:///work/b/billing.py", QUERY, workspace=b) == alone
