// The `context` of each request: snippets of other code, most relevant first.
// Chosen as llama.vscode and Copilot do: the regions the user edited lately,
// then the other open documents of the same language, most recently used
// first. The server puts context at the start of the prompt, so a snippet
// that changes costs a prefill of everything after it: the list changes only
// when the user moves on (edits elsewhere, switches editors), never while they
// type in one place. Snippets are snapshots taken at those moments, not the
// documents' live text. Each snippet carries its kind: "edit" (an edited
// region), "visited" (where the user left a document), "open" (a document open
// when the extension started). No vscode API.

import type { ContextItem, ContextKind } from './protocol';
import { nearbyText } from './text';

export interface ContextDocument {
  uri: string;
  languageId: string;
  lineCount: number;
  lineAt(line: number): string;
}

export interface ContextLimits {
  enabled: boolean;
  maxSnippets: number;
  maxChars: number;
}

interface Snippet extends ContextItem {
  languageId: string;
  /** The line the snippet is centred on. */
  line: number;
  kind: ContextKind;
}

/** Edits within this many lines of each other are one region. */
const REGION_LINES = 16;
/** A snippet of the document being completed is sent only this far from the cursor (nearer, the prompt has it). */
const SAME_DOCUMENT_DISTANCE = 80;
/** Edited regions remembered. */
const MAX_EDITED = 16;
/** Open documents remembered. */
const MAX_OPEN = 32;

export class ContextCollector {
  /** Snapshots of edited regions, most recent first. */
  private edited: Snippet[] = [];
  /** Snapshots of documents seen, most recently used first. */
  private open: Snippet[] = [];
  /** The region being edited now: its snippet is taken when the user moves on. */
  private editing: { doc: ContextDocument; line: number } | undefined;

  constructor(
    private limits: () => ContextLimits,
    /** Whether a document may be read at all (privacy.ts); asked again before each use, as settings change. */
    private readonly readable: (uri: string, languageId: string) => boolean,
  ) {}

  /** The document changed at `line`. */
  changed(doc: ContextDocument, line: number): void {
    const e = this.editing;
    if (e && e.doc.uri === doc.uri && Math.abs(e.line - line) <= REGION_LINES) {
      e.line = line;
      return;
    }
    this.finishEditing();
    this.editing = { doc, line };
  }

  /** The user left `doc` (another editor became active) with the cursor at `line`. */
  left(doc: ContextDocument, line: number): void {
    if (this.editing?.doc.uri === doc.uri) {
      this.finishEditing();
    }
    this.remember(doc, line, true);
  }

  /** A document open when the extension started; remembered behind those used since. */
  seen(doc: ContextDocument, line: number): void {
    if (!this.open.some((s) => s.uri === doc.uri)) {
      this.remember(doc, line, false);
    }
  }

  closed(uri: string): void {
    this.open = this.open.filter((s) => s.uri !== uri);
    if (this.editing?.doc.uri === uri) {
      this.finishEditing();
    }
  }

  /** The context for a request in document `uri` (of `languageId`) at `line`. */
  forRequest(uri: string, languageId: string, line: number): ContextItem[] {
    const limits = this.limits();
    const max = Math.min(64, Math.floor(limits.maxSnippets)); // the protocol's bound
    if (!limits.enabled || max <= 0 || limits.maxChars <= 0) {
      return [];
    }
    const out: ContextItem[] = [];
    const fromEdits = new Set<string>();
    const consider = (s: Snippet, whole: boolean) => {
      if (out.length >= max || s.languageId !== languageId || !s.text.trim() || !this.readable(s.uri, s.languageId)) {
        return;
      }
      if (s.uri === uri && (whole || Math.abs(s.line - line) <= SAME_DOCUMENT_DISTANCE)) {
        return; // the prompt has this part of the document itself
      }
      if (whole && fromEdits.has(s.uri)) {
        return; // its edited region came first
      }
      fromEdits.add(s.uri);
      out.push({ uri: s.uri, text: s.text.length > limits.maxChars ? s.text.slice(0, limits.maxChars) : s.text, kind: s.kind });
    };
    this.edited.forEach((s) => consider(s, false));
    this.open.forEach((s) => consider(s, true));
    return out;
  }

  private finishEditing(): void {
    const e = this.editing;
    this.editing = undefined;
    if (!e) {
      return;
    }
    const snippet = this.snapshot(e.doc, e.line, 'edit');
    if (!snippet) {
      return;
    }
    // A region edited again replaces its older snapshot, here at the front.
    this.edited = [snippet, ...this.edited.filter((s) => s.uri !== e.doc.uri || Math.abs(s.line - e.line) > REGION_LINES)]
      .slice(0, MAX_EDITED);
  }

  private remember(doc: ContextDocument, line: number, recent: boolean): void {
    const snippet = this.snapshot(doc, line, recent ? 'visited' : 'open');
    const others = this.open.filter((s) => s.uri !== doc.uri);
    if (!snippet) {
      this.open = others;
      return;
    }
    this.open = (recent ? [snippet, ...others] : [...others, snippet]).slice(0, MAX_OPEN);
  }

  private snapshot(doc: ContextDocument, line: number, kind: ContextKind): Snippet | undefined {
    if (!this.readable(doc.uri, doc.languageId)) {
      return undefined;
    }
    const text = nearbyText(doc.lineCount, (i) => doc.lineAt(i), line, this.limits().maxChars);
    return { uri: doc.uri, languageId: doc.languageId, line, text, kind };
  }
}
