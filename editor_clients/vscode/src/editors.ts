// What the editors tell the extension: edits and editor switches (for the
// context), keystrokes (their request sent at once, keystroke.ts), a document
// that became active (primed), accepts of a suggestion
// (credited, then the next line fetched), cursor moves off it (dismissed).

import * as vscode from 'vscode';

import type { Settings } from './config';
import type { ContextCollector, ContextDocument } from './context';
import type { Definitions } from './definitions';
import { documentText, textSource } from './documents';
import { typedCursor } from './keystroke';
import type { Prefetcher } from './prefetch';
import { ACCEPTED_COMMAND, CompleterProvider } from './provider';

/** Documents worth reading as context or priming (not output panes, git views, settings). */
const DOCUMENT_SCHEMES = new Set(['file', 'untitled', 'vscode-remote', 'vscode-notebook-cell']);

export interface EditorParts {
  provider: CompleterProvider;
  prefetch: Prefetcher;
  context: ContextCollector;
  definitions?: Definitions;
  settings: () => Settings;
}

function contextDocument(doc: vscode.TextDocument): ContextDocument {
  return { uri: doc.uri.toString(), languageId: doc.languageId, lineCount: doc.lineCount, lineAt: (i) => doc.lineAt(i).text };
}

/** What the editor inserts for one level of indentation. */
function indentUnit(editor: vscode.TextEditor): string {
  const options = editor.options ?? {};
  return options.insertSpaces === false ? '\t' : ' '.repeat(typeof options.tabSize === 'number' ? options.tabSize : 4);
}

export function watchEditors({ provider, prefetch, context, definitions, settings }: EditorParts) {
  const tracker = provider.tracker;
  const usable = (doc: vscode.TextDocument) => DOCUMENT_SCHEMES.has(doc.uri.scheme);
  /** Look up what `doc` imports, in the background (a no-op while its import lines stay the same). */
  const lookUp = (doc: vscode.TextDocument) => {
    if (definitions && usable(doc)) {
      void definitions.refresh({ uri: doc.uri.toString(), languageId: doc.languageId, text: doc.getText() });
    }
  };
  /** The active editor's document and cursor line, for the context snapshot taken when it is left. */
  let current: { doc: vscode.TextDocument; line: number } | undefined;

  const primeActive = () => {
    const editor = vscode.window.activeTextEditor;
    if (editor && settings().prime && usable(editor.document) && provider.allows(editor.document)) {
      prefetch.prime(documentText(editor.document), editor.document.offsetAt(editor.selection.active));
    }
  };

  /** Our partial accepts run VS Code's own, and credit what it inserted to the suggestion. */
  const acceptPartly = async (builtin: string) => {
    const before = vscode.window.activeTextEditor;
    if (before && tracker.current) {
      tracker.observe(textSource(before.document), before.document.offsetAt(before.selection.active), 'typed');
    }
    provider.accepting = true;
    try {
      await vscode.commands.executeCommand(builtin);
    } finally {
      provider.accepting = false;
    }
    const editor = vscode.window.activeTextEditor;
    if (editor && tracker.current) {
      tracker.observe(textSource(editor.document), editor.document.offsetAt(editor.selection.active), 'accepted');
      if (tracker.current) {
        tracker.current.version = editor.document.version;
      }
    }
  };

  const acceptedWhole = (id: unknown, index: unknown) => {
    const editor = vscode.window.activeTextEditor;
    const cursor = editor ? editor.document.offsetAt(editor.selection.active) : undefined;
    tracker.acceptedWhole(String(id), Number(index ?? 0), editor ? textSource(editor.document) : undefined, cursor);
    if (editor && cursor !== undefined && settings().speculate && provider.allows(editor.document)) {
      prefetch.speculate(documentText(editor.document), cursor, indentUnit(editor));
    }
  };

  // The documents open as the extension starts; later ones count once the user has been in them
  // (left them), not when something opens them in the background: that would change the context
  // while the user types.
  for (const editor of vscode.window.visibleTextEditors.filter((e) => usable(e.document))) {
    context.seen(contextDocument(editor.document), editor.selection.active.line);
  }
  for (const doc of vscode.workspace.textDocuments) {
    if (usable(doc)) {
      context.seen(contextDocument(doc), 0);
    }
  }
  const active = vscode.window.activeTextEditor;
  current = active ? { doc: active.document, line: active.selection.active.line } : undefined;
  if (active) {
    lookUp(active.document);
  }

  const subscriptions: vscode.Disposable[] = [
    vscode.commands.registerCommand(ACCEPTED_COMMAND, acceptedWhole),
    vscode.commands.registerCommand('completer.acceptNextWord', () => acceptPartly('editor.action.inlineSuggest.acceptNextWord')),
    vscode.commands.registerCommand('completer.acceptNextLine', () => acceptPartly('editor.action.inlineSuggest.acceptNextLine')),
    vscode.commands.registerCommand('completer.dismiss', async () => {
      tracker.finish('dismissed');
      await vscode.commands.executeCommand('editor.action.inlineSuggest.hide');
    }),
    vscode.window.onDidChangeTextEditorSelection((e) => {
      const doc = e.textEditor.document;
      if (current?.doc === doc) {
        current.line = e.selections[0]?.active.line ?? current.line;
      }
      const shown = tracker.current;
      // A cursor move (no edit since we last looked) off the suggestion dismisses it;
      // edits are judged by the provider and the accept commands.
      if (shown && !provider.accepting && shown.uri === doc.uri.toString() && shown.version === doc.version) {
        const sel = e.selections;
        if (sel.length !== 1 || !sel[0].isEmpty || tracker.match(textSource(doc), doc.offsetAt(sel[0].active)) === undefined) {
          tracker.finish('dismissed');
        }
      }
    }),
    vscode.window.onDidChangeActiveTextEditor((editor) => {
      if (current && current.doc !== editor?.document && usable(current.doc)) {
        context.left(contextDocument(current.doc), current.line);
      }
      current = editor ? { doc: editor.document, line: editor.selection.active.line } : undefined;
      const shown = tracker.current;
      if (shown && (!editor || editor.document.uri.toString() !== shown.uri)) {
        tracker.finish('dismissed');
      }
      primeActive();
      if (editor) {
        lookUp(editor.document);
      }
    }),
    vscode.workspace.onDidChangeTextDocument((e) => {
      if (usable(e.document) && e.contentChanges.length > 0) {
        context.changed(contextDocument(e.document), e.contentChanges[0].range.start.line);
        // Only an edit on an import line can change what is imported; the lookup is skipped when they did not.
        const text = e.document.lineAt(e.contentChanges[0].range.start.line).text;
        if (/^\s*(from|import)\s/.test(text) || e.contentChanges.some((c) => c.text.includes('\n'))) {
          lookUp(e.document);
        }
        // After the context took the edit in: what the request sent now carries is what the provider's would.
        const cursor = typedCursor(e);
        if (cursor === undefined) {
          provider.early.typedIn(e.document.uri.toString());
        } else {
          provider.requestAtKeystroke(e.document, cursor, e.contentChanges[0].range);
        }
      }
    }),
    vscode.workspace.onDidCloseTextDocument((doc) => {
      context.closed(doc.uri.toString());
      definitions?.closed(doc.uri.toString());
    }),
  ];
  return { subscriptions, primeActive };
}
