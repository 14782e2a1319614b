// The suggestion on screen: how much of it the document holds now (typed
// through or accepted), what is left to show, and how its life ended. A
// suggestion may offer several texts (`done.text` and `done.candidates`);
// those the document still agrees with stay alive. No vscode API: a document
// is seen through `TextSource`.

import { codePointsBetween } from './protocol';

export interface TextSource {
  uri: string;
  /** The document's text between two offsets (clamped to the document). */
  text(start: number, end: number): string;
}

export type FinishHow = 'accepted' | 'typed' | 'dismissed' | 'replaced';

/** One text offered: its index among the request's (0: `done.text`, i: `done.candidates[i - 1]`). */
export interface Alternative {
  index: number;
  text: string;
}

export interface Shown {
  id: string;
  uri: string;
  /** Offset where the suggestion starts (the cursor when it was shown). */
  start: number;
  /** The texts still consistent with the document, the one the editor shows first. */
  alive: Alternative[];
  /** The document just before `start` and just after the cursor, when shown. */
  before: string;
  after: string;
  /** UTF-16 units of the suggestion the document holds at `start` now. */
  consumed: number;
  /** Who put each of those units there: `a` an accept action (whole, next word, next line), `t` typing. */
  marks: string;
  /** The document version when last looked at (set by the caller). */
  version?: number;
  /** UTF-16 units at the start of each text that the client added (a line break before a next line): not the server's. */
  lead: number;
}

/** The texts of a `done` (`text`, then `candidates`) worth showing, each once, with their index. */
export function alternativesOf(texts: string[]): Alternative[] {
  const seen = new Set<string>();
  const out: Alternative[] = [];
  texts.forEach((text, index) => {
    if (text.trim() !== '' && !seen.has(text)) {
      seen.add(text);
      out.push({ index, text });
    }
  });
  return out;
}

/** The text the suggestion stands for now: the first alive one. */
export function shownText(s: Shown): string {
  return s.alive[0].text;
}

/** What the document holds of the suggestion, in code points (as the server counts), by who put it there. */
export function keptChars(s: Shown): { accepted: number; typed: number } {
  const text = shownText(s);
  const kept = { accepted: 0, typed: 0 };
  for (let i = s.lead; i < s.marks.length; i++) {
    if (codePointsBetween(text, i, i + 1) > 0) { // not the second half of a surrogate pair
      kept[s.marks[i] === 'a' ? 'accepted' : 'typed'] += 1;
    }
  }
  return kept;
}

const CONTEXT_CHARS = 256;

export class ShownTracker {
  current: Shown | undefined;

  constructor(private readonly onFinish: (shown: Shown, how: FinishHow) => void) {}

  /** A new suggestion at `cursor`; the one before it ends (`replaced`). */
  show(id: string, doc: TextSource, cursor: number, alternatives: Alternative[], lead = 0): void {
    this.finish('replaced');
    const alive = alternatives.filter((a) => a.text.length > 0);
    if (alive.length === 0) {
      return;
    }
    this.current = {
      id, uri: doc.uri, start: cursor, alive,
      before: doc.text(Math.max(0, cursor - CONTEXT_CHARS), cursor),
      after: doc.text(cursor, cursor + CONTEXT_CHARS),
      consumed: 0, marks: '', lead,
    };
  }

  /**
   * How much of the suggestion the document holds with the cursor at
   * `cursor`, and which texts agree with it; undefined when none does.
   */
  match(doc: TextSource, cursor: number): { n: number; alive: Alternative[] } | undefined {
    const s = this.current;
    if (!s || doc.uri !== s.uri || cursor < s.start) {
      return undefined;
    }
    const n = cursor - s.start;
    if (doc.text(s.start - s.before.length, s.start) !== s.before
      || doc.text(cursor, cursor + s.after.length) !== s.after) {
      return undefined;
    }
    const typed = doc.text(s.start, cursor);
    const alive = s.alive.filter((a) => a.text.length >= n && a.text.startsWith(typed));
    return alive.length > 0 ? { n, alive } : undefined;
  }

  /**
   * Look at the document again; what changed since the last look is credited
   * to `by`. Returns the texts still to show (the rest of each alive one), or
   * undefined when there are none: the suggestion ended, fully consumed, or
   * the document diverged (dismissed).
   */
  observe(doc: TextSource, cursor: number, by: 'typed' | 'accepted'): Alternative[] | undefined {
    const s = this.current;
    if (!s) {
      return undefined;
    }
    const found = this.match(doc, cursor);
    if (found === undefined) {
      this.finish('dismissed');
      return undefined;
    }
    const { n, alive } = found;
    // Growth is credited to `by`; backspacing takes back the latest units, whoever put them there.
    s.marks = n > s.consumed ? s.marks + (by === 'accepted' ? 'a' : 't').repeat(n - s.consumed) : s.marks.slice(0, n);
    s.consumed = n;
    const rest = alive.filter((a) => a.text.length > n);
    if (rest.length === 0) {
      s.alive = alive;
      this.finish(by === 'accepted' ? 'accepted' : 'typed');
      return undefined;
    }
    s.alive = rest;
    return rest.map((a) => ({ index: a.index, text: a.text.slice(n) }));
  }

  /**
   * The whole of text `index` was accepted (its item's command ran). When the
   * document cannot be matched (the editor adjusted the inserted text), all
   * that was left of it is credited as accepted.
   */
  acceptedWhole(id: string, index: number, doc: TextSource | undefined, cursor: number | undefined): void {
    const s = this.current;
    const chosen = s?.alive.find((a) => a.index === index) ?? s?.alive[0];
    if (!s || s.id !== id || !chosen) {
      return;
    }
    s.alive = [chosen, ...s.alive.filter((a) => a !== chosen)];
    const found = doc && cursor !== undefined ? this.match(doc, cursor) : undefined;
    const n = found && found.alive[0] === chosen ? found.n : undefined;
    const end = n === undefined || n < s.consumed ? chosen.text.length : n;
    s.marks = s.marks.slice(0, Math.min(s.consumed, end)) + 'a'.repeat(Math.max(0, end - s.consumed));
    s.consumed = end;
    this.finish('accepted');
  }

  /** End the current suggestion (if any) and report it. */
  finish(how: FinishHow): void {
    const s = this.current;
    if (!s) {
      return;
    }
    this.current = undefined;
    this.onFinish(s, how);
  }
}
