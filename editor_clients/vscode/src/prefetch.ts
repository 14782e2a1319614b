// Requests sent before the user asks. Priming: when a document is opened or
// becomes active, `max_tokens: 0` has the server prefill its prompt, so the
// first keystroke there finds the cache warm. Speculation: right after a whole
// suggestion is accepted at the end of a line, the next line is asked for
// (`supersede: false`, so nothing in flight is ended by it); the provider
// shows it at once, or the cache does after Enter. No vscode API.

import type { CompletionCache, Place } from './cache';
import { CompleterClient, CompleteParams, PendingCompletion } from './client';
import { nextLineIndent } from './text';
import { Alternative, alternativesOf } from './tracker';

/** A document as a request sees it. */
export interface DocumentText {
  uri: string;
  languageId: string;
  version: number;
  text: string;
}

export interface Speculation {
  /** Where it was asked from: the end of the accepted text. */
  uri: string;
  version: number;
  cursor: number;
  /** What Enter inserts there: the line break and the next line's indentation. */
  lead: string;
  /** The place of the next line, where the cache keeps the answer. */
  place: Place;
  /** Its completions (the next line's text, without `lead`), none when it failed. */
  result: Promise<{ id: string; alternatives: Alternative[] } | undefined>;
}

export class Prefetcher {
  private primed = '';
  private priming: PendingCompletion | undefined;
  /** Set when a server refuses `max_tokens: 0` (older than priming): not tried again on this connection. */
  private primeUnsupported = false;
  private speculation: Speculation | undefined;

  constructor(
    private readonly client: CompleterClient,
    private readonly cache: CompletionCache,
    /** What the provider would send at `cursor` of `doc` (context, limits); adjusted here. */
    private readonly params: (doc: DocumentText, cursor: number) => CompleteParams,
  ) {
    client.on('ready', () => {
      this.primeUnsupported = false;
      this.primed = '';
    });
  }

  /** Prefill `doc`'s prompt at `cursor`, once per document version and cursor. */
  prime(doc: DocumentText, cursor: number): void {
    const key = `${doc.uri}\n${doc.version}\n${cursor}`;
    if (this.primeUnsupported || !this.client.connected || key === this.primed) {
      return;
    }
    this.primed = key;
    this.priming?.cancel(); // the one before is for a document left already
    const params: CompleteParams = { ...this.params(doc, cursor), max_tokens: 0 };
    delete params.n;
    let pending: PendingCompletion;
    try {
      pending = this.client.complete(params, { purpose: 'prime' });
    } catch {
      return; // disconnected meanwhile: the next connection primes nothing until the next switch
    }
    this.priming = pending;
    void pending.result.then((r) => {
      if (this.priming === pending) {
        this.priming = undefined;
      }
      if (r.reason === 'error' && r.error?.code === 'bad_request' && /max_tokens/.test(r.error.message)) {
        this.primeUnsupported = true;
      }
    });
  }

  /**
   * The whole suggestion was accepted, the cursor now at `cursor`: when the
   * line is complete (nothing but blanks after the cursor), ask for the next.
   * `indentUnit`: what the editor indents a block with.
   */
  speculate(doc: DocumentText, cursor: number, indentUnit: string): void {
    this.speculation = undefined;
    const lineEnd = doc.text.indexOf('\n', cursor);
    if (!this.client.connected || doc.text.slice(cursor, lineEnd < 0 ? doc.text.length : lineEnd).trim() !== '') {
      return;
    }
    const line = doc.text.slice(doc.text.lastIndexOf('\n', cursor - 1) + 1, cursor);
    const lead = `\n${nextLineIndent(line, indentUnit)}`;
    const next: DocumentText = { ...doc, text: doc.text.slice(0, cursor) + lead + doc.text.slice(cursor) };
    const at = cursor + lead.length;
    const place: Place = { uri: doc.uri, prefix: next.text.slice(0, at), suffix: next.text.slice(at) };
    let pending: PendingCompletion;
    try {
      pending = this.client.complete({ ...this.params(next, at), supersede: false }, { purpose: 'speculative' });
    } catch {
      return; // disconnected meanwhile: nothing to prefetch
    }
    const result = pending.result.then((r) => {
      const ended = r.reason === 'stop' || r.reason === 'length' || r.reason === 'eos' || r.reason === 'deadline';
      const alternatives = ended ? alternativesOf([r.text, ...r.candidates]) : [];
      if (alternatives.length === 0) {
        return undefined;
      }
      // Not reported as unused when the cache cannot keep it: the provider may show it yet.
      this.cache.put(place, { id: r.id, alternatives });
      return { id: r.id, alternatives };
    });
    this.speculation = { uri: doc.uri, version: doc.version, cursor, lead, place, result };
  }

  /** The speculation made from exactly this state of the document, if any. */
  speculationAt(doc: DocumentText, cursor: number): Speculation | undefined {
    const s = this.speculation;
    return s && s.uri === doc.uri && s.version === doc.version && s.cursor === cursor ? s : undefined;
  }

  /** The speculation whose next line is this place (Enter was pressed before it was shown), if any. */
  speculationFor(place: Place): Speculation | undefined {
    const s = this.speculation;
    return s && s.place.uri === place.uri && s.place.prefix === place.prefix && s.place.suffix === place.suffix
      ? s : undefined;
  }
}
