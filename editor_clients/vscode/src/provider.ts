// The inline completion provider: when to ask (debounce, no selection or
// multi-cursor), what to send (prefix/suffix, mode, nearby text of other
// editors), and type-through of the suggestion on screen.

import * as vscode from 'vscode';

import { CompleteParams, CompleterClient, ContextItem, NotConnectedError, PendingCompletion } from './client';
import type { Settings } from './config';
import { AdaptiveDebounce } from './debounce';
import type { Stats } from './stats';
import { capPrefix, capSuffix, chooseMode, nearbyText } from './text';
import { FinishHow, Shown, ShownTracker, TextSource } from './tracker';

/** Run by VS Code after the whole suggestion is accepted (the item's command). */
export const ACCEPTED_COMMAND = 'completer.accepted';
/** Context key: one of our suggestions is on screen (keybindings use it). */
export const VISIBLE_CONTEXT = 'completer.suggestionVisible';

const CONTEXT_SCHEMES = new Set(['file', 'untitled', 'vscode-remote', 'vscode-notebook-cell']);
const RECENT_DOCUMENTS = 20;

export function textSource(doc: vscode.TextDocument): TextSource {
  return {
    uri: doc.uri.toString(),
    text: (start, end) => (end <= start ? '' : doc.getText(new vscode.Range(doc.positionAt(Math.max(0, start)), doc.positionAt(end)))),
  };
}

/** Resolves true after `ms`, false as soon as `token` is cancelled. */
function sleep(ms: number, token: vscode.CancellationToken): Promise<boolean> {
  if (token.isCancellationRequested) {
    return Promise.resolve(false);
  }
  if (ms <= 0) {
    return Promise.resolve(true);
  }
  return new Promise((resolve) => {
    const timer = setTimeout(() => {
      sub.dispose();
      resolve(true);
    }, ms);
    const sub = token.onCancellationRequested(() => {
      clearTimeout(timer);
      sub.dispose();
      resolve(false);
    });
  });
}

export class CompleterProvider implements vscode.InlineCompletionItemProvider {
  readonly tracker: ShownTracker;
  readonly debounce: AdaptiveDebounce;
  /** Set while our partial-accept command runs: document growth then counts as accepted, not typed. */
  accepting = false;
  private recent: { uri: string; line: number }[] = [];

  constructor(
    private readonly client: CompleterClient,
    private readonly stats: Stats,
    private readonly settings: () => Settings,
    onFinish: (shown: Shown, how: FinishHow) => void,
  ) {
    const s = settings();
    this.debounce = new AdaptiveDebounce({ minMs: s.debounceMinMs, maxMs: s.debounceMaxMs });
    this.tracker = new ShownTracker(onFinish);
  }

  async provideInlineCompletionItems(
    document: vscode.TextDocument,
    position: vscode.Position,
    context: vscode.InlineCompletionContext,
    token: vscode.CancellationToken,
  ): Promise<vscode.InlineCompletionItem[] | undefined> {
    const settings = this.settings();
    if (!settings.enabled) {
      return undefined;
    }
    const editor = vscode.window.activeTextEditor;
    if (editor && editor.document === document && (editor.selections.length > 1 || !editor.selection.isEmpty)) {
      return undefined; // no request while a selection or multi-cursor is active
    }
    const cursor = document.offsetAt(position);
    const source = textSource(document);
    if (this.tracker.current) {
      const rest = this.tracker.observe(source, cursor, this.accepting ? 'accepted' : 'typed');
      const shown = this.tracker.current;
      if (rest !== undefined && shown) {
        shown.version = document.version;
        this.stats.typeThrough += 1;
        return [this.item(shown.id, rest, position)];
      }
    }
    if (context.selectedCompletionInfo) {
      return undefined; // the suggest widget is open: leave the preview to it
    }
    if (!this.client.connected) {
      this.stats.skippedOffline += 1;
      return undefined; // quiet: the status bar says why
    }
    if (context.triggerKind === vscode.InlineCompletionTriggerKind.Automatic) {
      this.debounce.keystroke(Date.now());
      if (!(await sleep(this.debounce.delayMs(), token))) {
        return undefined;
      }
    }
    if (token.isCancellationRequested) {
      return undefined;
    }
    const version = document.version;
    let pending: PendingCompletion;
    try {
      pending = this.client.complete(this.request(document, position, settings));
    } catch (e) {
      if (e instanceof NotConnectedError) {
        this.stats.skippedOffline += 1;
        return undefined;
      }
      throw e;
    }
    this.stats.request();
    const sub = token.onCancellationRequested(() => pending.cancel());
    const result = await pending.result.finally(() => {
      sub.dispose();
    });
    if (result.reason !== 'cancelled' && result.reason !== 'error' && result.reason !== 'disconnected') {
      this.debounce.latency(result.latencyMs);
    }
    if (token.isCancellationRequested || document.version !== version
      || (result.reason !== 'stop' && result.reason !== 'length' && result.reason !== 'eos' && result.reason !== 'deadline')
      || result.text.trim() === '') {
      return undefined;
    }
    this.tracker.show(result.id, source, cursor, result.text);
    if (this.tracker.current) {
      this.tracker.current.version = version;
    }
    this.stats.show(result.text);
    void vscode.commands.executeCommand('setContext', VISIBLE_CONTEXT, true);
    return [this.item(result.id, result.text, position)];
  }

  /** Remember where the cursor was in a document (for the context of other requests). */
  noteCursor(document: vscode.TextDocument, line: number): void {
    const uri = document.uri.toString();
    this.recent = [{ uri, line }, ...this.recent.filter((r) => r.uri !== uri)].slice(0, RECENT_DOCUMENTS);
  }

  request(document: vscode.TextDocument, position: vscode.Position, settings: Settings): CompleteParams {
    const text = document.getText();
    const cursor = document.offsetAt(position);
    const params: CompleteParams = {
      document: {
        uri: document.uri.toString(),
        language: document.languageId,
        prefix: capPrefix(text.slice(0, cursor)),
        suffix: capSuffix(text.slice(cursor)),
      },
      context: this.contextFor(document, settings),
      mode: chooseMode(document.lineAt(position.line).text,
        position.line > 0 ? document.lineAt(position.line - 1).text : undefined),
    };
    if (settings.maxTokens > 0) {
      params.max_tokens = Math.round(settings.maxTokens);
    }
    if (settings.deadlineMs > 0) {
      params.deadline_ms = settings.deadlineMs;
    }
    return params;
  }

  /** Nearby text of other visible editors, then of recently used documents; same language first. */
  contextFor(document: vscode.TextDocument, settings: Settings): ContextItem[] {
    const max = Math.floor(settings.contextMaxSnippets);
    if (max <= 0 || settings.contextMaxChars <= 0) {
      return [];
    }
    const self = document.uri.toString();
    const seen = new Set([self]);
    const candidates: { doc: vscode.TextDocument; line: number }[] = [];
    const add = (doc: vscode.TextDocument | undefined, line: number) => {
      const uri = doc?.uri.toString();
      if (doc && uri && !seen.has(uri) && CONTEXT_SCHEMES.has(doc.uri.scheme)) {
        seen.add(uri);
        candidates.push({ doc, line });
      }
    };
    for (const e of vscode.window.visibleTextEditors) {
      add(e.document, e.selection.active.line);
    }
    const open = new Map(vscode.workspace.textDocuments.map((d) => [d.uri.toString(), d]));
    for (const r of this.recent) {
      add(open.get(r.uri), r.line);
    }
    const sameLanguage = candidates.filter((c) => c.doc.languageId === document.languageId);
    const others = candidates.filter((c) => c.doc.languageId !== document.languageId);
    const out: ContextItem[] = [];
    for (const { doc, line } of [...sameLanguage, ...others]) {
      if (out.length >= max) {
        break;
      }
      const text = nearbyText(doc.lineCount, (i) => doc.lineAt(i).text, line, settings.contextMaxChars);
      if (text.trim()) {
        out.push({ uri: doc.uri.toString(), text });
      }
    }
    return out;
  }

  private item(id: string, text: string, position: vscode.Position): vscode.InlineCompletionItem {
    return new vscode.InlineCompletionItem(text, new vscode.Range(position, position),
      { title: 'completer: accepted', command: ACCEPTED_COMMAND, arguments: [id] });
  }
}
