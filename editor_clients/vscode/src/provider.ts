// The inline completion provider: what may be completed (settings, privacy,
// no selection or multi-cursor), then the cheapest source of a suggestion
// first: the one on screen typed through, the next line fetched after an
// accept, the cache, then the request sent at the keystroke that left the
// document so (keystroke.ts), and only then a request (debounced), whose
// answer is shown with its alternatives (`done.candidates`) to cycle
// through. While the suggest widget is open, the document is taken as if its
// selected item were inserted, and what is offered starts with that item
// (VS Code shows only a suggestion that extends it).

import * as vscode from 'vscode';

import type { CompletionCache, Place } from './cache';
import { CompleteParams, CompleterClient, NotConnectedError, PendingCompletion } from './client';
import type { Settings } from './config';
import type { ContextCollector } from './context';
import type { Definitions } from './definitions';
import { AdaptiveDebounce } from './debounce';
import { asIfSelected, AsIfSelected, documentText, lineOf, sleep, textSource, unlessCancelled } from './documents';
import type { FeedbackLedger } from './feedback';
import { Answer, EarlyRequests } from './keystroke';
import type { DocumentText, Prefetcher, Speculation } from './prefetch';
import type { PrivacyFilter } from './privacy';
import type { Stats } from './stats';
import { documentAt, modeAt } from './text';
import { Alternative, alternativesOf, FinishHow, Shown, ShownTracker } from './tracker';

/** The URI schemes the provider is registered for (extension.ts). */
export const PROVIDED_SCHEMES = ['file', 'untitled', 'vscode-remote'];
/** Run by VS Code after a whole suggestion is accepted (the item's command; arguments: id, alternative). */
export const ACCEPTED_COMMAND = 'completer.accepted';
/** Context key: one of our suggestions is on screen (keybindings use it). */
export const VISIBLE_CONTEXT = 'completer.suggestionVisible';

/** The parts the provider works with (built and wired by extension.ts). */
export interface ProviderParts {
  client: CompleterClient;
  stats: Stats;
  settings: () => Settings;
  privacy: PrivacyFilter;
  cache: CompletionCache;
  context: ContextCollector;
  /** The definitions of what documents import (optional: tests may leave it out). */
  definitions?: Definitions;
  /** The workspace folder URI a document belongs to, if any. */
  workspaceOf?: (uri: string) => string | undefined;
  prefetch: Prefetcher;
  feedback: FeedbackLedger;
  onFinish: (shown: Shown, how: FinishHow) => void;
}

export class CompleterProvider implements vscode.InlineCompletionItemProvider {
  readonly tracker: ShownTracker;
  readonly debounce: AdaptiveDebounce;
  /** The request sent at the last keystroke, for the provider's call that follows it. */
  readonly early = new EarlyRequests((r) => void r.answer.then((end) => {
    if (end && !end.kept) {
      this.parts.feedback.dropped(end.id);
    }
  }));
  /** Set while our partial-accept command runs: document growth then counts as accepted, not typed. */
  accepting = false;

  constructor(private readonly parts: ProviderParts) {
    const s = parts.settings();
    this.debounce = new AdaptiveDebounce({ minMs: s.debounceMinMs, maxMs: s.debounceMaxMs });
    this.tracker = new ShownTracker(parts.onFinish);
  }

  /** Whether `document` may be completed (and read) at all. */
  allows(document: vscode.TextDocument): boolean {
    return this.parts.settings().enabled && this.parts.privacy.allows(document.uri.toString(), document.languageId);
  }

  async provideInlineCompletionItems(
    document: vscode.TextDocument,
    position: vscode.Position,
    context: vscode.InlineCompletionContext,
    token: vscode.CancellationToken,
  ): Promise<vscode.InlineCompletionItem[] | undefined> {
    const { client, stats, cache, prefetch } = this.parts;
    if (!this.allows(document)) {
      return undefined;
    }
    const editor = vscode.window.activeTextEditor;
    if (editor && editor.document === document && (editor.selections.length > 1 || !editor.selection.isEmpty)) {
      return undefined; // no request while a selection or multi-cursor is active
    }
    const selected = context.selectedCompletionInfo;
    // The suggest widget is open: everything below is for the document as if its selected item were inserted.
    const asIf = selected ? asIfSelected(document, position, selected) : undefined;
    if (selected && !asIf) {
      return undefined;
    }
    const cursor = asIf ? asIf.cursor : document.offsetAt(position);
    const source = asIf ? asIf.source : textSource(document);
    if (this.tracker.current) {
      // Typed (or accepted) what the suggestion says: the rest, at once, with no request and no flicker.
      const rest = this.tracker.observe(source, cursor, this.accepting ? 'accepted' : 'typed');
      const shown = this.tracker.current;
      if (rest !== undefined && shown) {
        shown.version = document.version;
        stats.typeThrough += 1;
        return asIf ? this.items(shown.id, rest.map((a) => ({ index: a.index, text: asIf.head + a.text })), asIf.range)
          : this.items(shown.id, rest, new vscode.Range(position, position));
      }
    }
    const doc = asIf ? asIf.doc : documentText(document);
    const afterAccept = asIf ? undefined : prefetch.speculationAt(doc, cursor);
    if (afterAccept) {
      return this.showNextLine(afterAccept, document, position, token);
    }
    const place: Place = { uri: doc.uri, prefix: doc.text.slice(0, cursor), suffix: doc.text.slice(cursor) };
    const hit = cache.get(place);
    if (hit) {
      stats.cacheHits += 1;
      return this.show(hit.id, hit.alternatives, document, position, 0, asIf);
    }
    const ahead = asIf ? undefined : prefetch.speculationFor(place);
    if (ahead) { // Enter came before the next line did
      const next = await unlessCancelled(ahead.result, token);
      return next && document.version === doc.version ? this.show(next.id, next.alternatives, document, position) : undefined;
    }
    const early = asIf || context.triggerKind !== vscode.InlineCompletionTriggerKind.Automatic ? undefined
      : this.early.take(doc.uri, doc.version, cursor);
    if (early) { // sent at the keystroke that left the document so
      return this.answer(early.pending, early.answer, doc, document, position, token);
    }
    if (!client.connected) {
      stats.skippedOffline += 1;
      return undefined; // quiet: the status bar says why
    }
    if (context.triggerKind === vscode.InlineCompletionTriggerKind.Automatic) {
      if (!(await sleep(this.debounce.delayMs(Date.now()), token))) {
        return undefined;
      }
    }
    if (token.isCancellationRequested) {
      return undefined;
    }
    const asked = context.triggerKind === vscode.InlineCompletionTriggerKind.Invoke;
    return this.request(doc, place, document, position, token, asIf, asked);
  }

  /** The fields of a request at `cursor` of `doc` (also what prefetched requests send). */
  params(doc: DocumentText, cursor: number): CompleteParams {
    const settings = this.parts.settings();
    const line = lineOf(doc.text, cursor);
    const params: CompleteParams = {
      document: documentAt(doc.uri, doc.languageId, doc.text, cursor),
      context: [...this.parts.context.forRequest(doc.uri, doc.languageId, line),
        ...this.parts.definitions?.forRequest(doc.uri) ?? []].slice(0, 64), // the protocol's bound
      mode: modeAt(doc.text, cursor),
    };
    const workspace = this.parts.workspaceOf?.(doc.uri);
    if (workspace) {
      params.workspace = workspace;
    }
    if (settings.maxTokens > 0) {
      params.max_tokens = Math.round(settings.maxTokens);
    }
    if (settings.deadlineMs > 0) {
      params.deadline_ms = settings.deadlineMs;
    }
    if (settings.candidates > 1) {
      params.n = settings.candidates;
    }
    return params;
  }

  /** Send the request for `place` of `doc`; undefined when the connection is down. */
  private send(doc: DocumentText, place: Place, asked: boolean): PendingCompletion | undefined {
    const { client, stats } = this.parts;
    const params = this.params(doc, place.prefix.length);
    if (asked) {
      params.min_first_prob = 0; // the user asked (Trigger Inline Suggestion): show something, sure or not
    }
    try {
      const pending = client.complete(params);
      stats.request();
      return pending;
    } catch (e) {
      if (e instanceof NotConnectedError) {
        stats.skippedOffline += 1;
        return undefined;
      }
      throw e;
    }
  }

  /** The end of a request for `place`: the server's hold noted, the completions cached. */
  private async settle(pending: PendingCompletion, place: Place): Promise<Answer | undefined> {
    const result = await pending.result;
    if (result.holdMs !== undefined) {
      this.debounce.hold(result.holdMs, Date.now());
    }
    const ended = result.reason === 'stop' || result.reason === 'length' || result.reason === 'eos' || result.reason === 'deadline';
    const alternatives = ended ? alternativesOf([result.text, ...result.candidates]) : [];
    if (alternatives.length === 0) {
      return undefined;
    }
    // Kept even when too late to show: the user may come back to this place.
    return { id: result.id, alternatives, kept: this.parts.cache.put(place, { id: result.id, alternatives }) };
  }

  /**
   * A keystroke left `document` with the cursor at `cursor` (keystroke.ts):
   * the request the provider's call for this state would send, sent now,
   * when that call would send one (no suggestion typed through, no next line
   * fetched, no cached place) and at once (no hold from the server).
   */
  requestAtKeystroke(document: vscode.TextDocument, cursor: number, changed: vscode.Range): void {
    const { client, settings, cache, prefetch } = this.parts;
    const uri = document.uri.toString();
    this.early.typedIn(uri);
    const editor = vscode.window.activeTextEditor;
    // The active editor's one cursor, where the edit was (as it was before it, or after it): typed there.
    const at = editor?.selections.length === 1 && editor.selection.isEmpty ? editor.selection.active : undefined;
    if (!settings().requestOnKeystroke || !PROVIDED_SCHEMES.includes(document.uri.scheme) || !this.allows(document)
      || editor?.document !== document || !at || ![changed.start, changed.end, document.positionAt(cursor)].some((p) => p.isEqual(at))
      || this.accepting || !client.connected || this.debounce.delayMs(Date.now()) > 0) {
      return;
    }
    const doc = documentText(document);
    const place: Place = { uri, prefix: doc.text.slice(0, cursor), suffix: doc.text.slice(cursor) };
    const through = this.tracker.current ? this.tracker.match(textSource(document), cursor) : undefined;
    if (through?.alive.some((a) => a.text.length > through.n) // typed through, a rest to show (typed to its end: asked)
      || prefetch.speculationAt(doc, cursor) || prefetch.speculationFor(place) || cache.get(place)) {
      return;
    }
    const pending = this.send(doc, place, false);
    if (pending) {
      this.early.sent({ uri, version: doc.version, cursor, place, pending, answer: this.settle(pending, place) });
    }
  }

  private async request(doc: DocumentText, place: Place, document: vscode.TextDocument, position: vscode.Position,
    token: vscode.CancellationToken, asIf?: AsIfSelected, asked = false,
  ): Promise<vscode.InlineCompletionItem[] | undefined> {
    const pending = this.send(doc, place, asked);
    return pending && this.answer(pending, this.settle(pending, place), doc, document, position, token, asIf);
  }

  /** Show the answer of `pending` if the document is still as it was asked for; cancelled with `token`. */
  private async answer(pending: PendingCompletion, answer: Promise<Answer | undefined>, doc: DocumentText,
    document: vscode.TextDocument, position: vscode.Position, token: vscode.CancellationToken, asIf?: AsIfSelected,
  ): Promise<vscode.InlineCompletionItem[] | undefined> {
    const sub = token.onCancellationRequested(() => pending.cancel());
    const end = await answer.finally(() => {
      sub.dispose();
    });
    if (!end) {
      return undefined;
    }
    if (token.isCancellationRequested || document.version !== doc.version) {
      if (!end.kept) {
        this.parts.feedback.dropped(end.id);
      }
      return undefined;
    }
    return this.show(end.id, end.alternatives, document, position, 0, asIf);
  }

  /** Right after a whole accept at the end of a line: the next line, with the line break Enter would insert. */
  private async showNextLine(speculation: Speculation, document: vscode.TextDocument, position: vscode.Position,
    token: vscode.CancellationToken): Promise<vscode.InlineCompletionItem[] | undefined> {
    const version = document.version;
    const next = await unlessCancelled(speculation.result, token);
    if (!next || document.version !== version) {
      return undefined;
    }
    const lead = speculation.lead;
    return this.show(next.id, next.alternatives.map((a) => ({ index: a.index, text: lead + a.text })), document, position,
      lead.length);
  }

  /**
   * Show `alternatives` at `position`; with `asIf`, at the cursor of the
   * document as if the suggest widget's item were inserted (tracked there:
   * once the item is inserted the document is that one), each text after the
   * item's over its range.
   */
  private show(id: string, alternatives: Alternative[], document: vscode.TextDocument, position: vscode.Position,
    lead = 0, asIf?: AsIfSelected): vscode.InlineCompletionItem[] | undefined {
    this.tracker.show(id, asIf ? asIf.source : textSource(document), asIf ? asIf.cursor : document.offsetAt(position), alternatives,
      lead);
    const shown = this.tracker.current;
    if (!shown) {
      return undefined;
    }
    shown.version = document.version;
    this.parts.feedback.markDisplayed(id);
    this.parts.stats.show(alternatives[0].text.slice(lead));
    void vscode.commands.executeCommand('setContext', VISIBLE_CONTEXT, true);
    if (asIf) {
      return this.items(id, shown.alive.map((a) => ({ index: a.index, text: asIf.head + a.text })), asIf.range);
    }
    return this.items(id, shown.alive, new vscode.Range(position, position));
  }

  private items(id: string, alternatives: Alternative[], range: vscode.Range): vscode.InlineCompletionItem[] {
    return alternatives.map((a) => new vscode.InlineCompletionItem(a.text, range,
      { title: 'completer: accepted', command: ACCEPTED_COMMAND, arguments: [id, a.index] }));
  }
}
