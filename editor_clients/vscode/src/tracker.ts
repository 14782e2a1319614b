// The suggestion on screen: how much of it the document holds now (typed
// through or accepted), what is left to show, and the one `feedback` it gets
// when its life ends. No vscode API: a document is seen through `TextSource`.

export interface TextSource {
  uri: string;
  /** The document's text between two offsets (clamped to the document). */
  text(start: number, end: number): string;
}

export type FinishHow = 'accepted' | 'typed' | 'dismissed' | 'replaced';

export interface Shown {
  id: string;
  uri: string;
  /** Offset where the suggestion starts (the cursor when it was requested). */
  start: number;
  /** The whole completion (`done.text`). */
  text: string;
  /** The document just before `start` and just after the cursor, when shown. */
  before: string;
  after: string;
  /** Characters of `text` the document holds at `start` now. */
  consumed: number;
  /** Of those, inserted by an accept action (whole, next word, next line). */
  accepted: number;
  /** Of those, typed by the user. */
  typed: number;
  /** The document version when last looked at (set by the caller). */
  version?: number;
}

const CONTEXT_CHARS = 256;

export class ShownTracker {
  current: Shown | undefined;

  constructor(private readonly onFinish: (shown: Shown, how: FinishHow) => void) {}

  /** A new suggestion at `cursor`; the one before it ends (`replaced`). */
  show(id: string, doc: TextSource, cursor: number, text: string): void {
    this.finish('replaced');
    this.current = {
      id, uri: doc.uri, start: cursor, text,
      before: doc.text(Math.max(0, cursor - CONTEXT_CHARS), cursor),
      after: doc.text(cursor, cursor + CONTEXT_CHARS),
      consumed: 0, accepted: 0, typed: 0,
    };
  }

  /** How much of the suggestion the document holds with the cursor at `cursor`; undefined when it no longer applies. */
  match(doc: TextSource, cursor: number): number | undefined {
    const s = this.current;
    if (!s || doc.uri !== s.uri || cursor < s.start || cursor - s.start > s.text.length) {
      return undefined;
    }
    const n = cursor - s.start;
    if (doc.text(s.start - s.before.length, s.start) !== s.before
      || doc.text(s.start, cursor) !== s.text.slice(0, n)
      || doc.text(cursor, cursor + s.after.length) !== s.after) {
      return undefined;
    }
    return n;
  }

  /**
   * Look at the document again; what changed since the last look is credited
   * to `by`. Returns the rest of the suggestion to keep showing, or undefined
   * when there is none (it ended: fully consumed, or the document diverged,
   * which counts as dismissed).
   */
  observe(doc: TextSource, cursor: number, by: 'typed' | 'accepted'): string | undefined {
    const s = this.current;
    if (!s) {
      return undefined;
    }
    const n = this.match(doc, cursor);
    if (n === undefined) {
      this.finish('dismissed');
      return undefined;
    }
    const grown = n - s.consumed;
    if (grown > 0) {
      if (by === 'accepted') {
        s.accepted += grown;
      } else {
        s.typed += grown;
      }
    }
    s.consumed = n;
    if (n >= s.text.length) {
      this.finish(by === 'accepted' ? 'accepted' : 'typed');
      return undefined;
    }
    return s.text.slice(n);
  }

  /**
   * The whole suggestion was accepted (its item's command ran). When the
   * document cannot be matched (the editor adjusted the inserted text), all
   * that was left is credited as accepted.
   */
  acceptedWhole(id: string, doc: TextSource | undefined, cursor: number | undefined): void {
    const s = this.current;
    if (!s || s.id !== id) {
      return;
    }
    const n = doc && cursor !== undefined ? this.match(doc, cursor) : undefined;
    const end = n === undefined || n < s.consumed ? s.text.length : n;
    s.accepted += Math.max(0, end - s.consumed);
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
    s.accepted = Math.min(s.accepted, s.text.length);
    this.onFinish(s, how);
  }
}
