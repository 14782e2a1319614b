// Requests sent at the keystroke (`completer.requestOnKeystroke`). VS Code
// calls an inline completion provider 50 ms after an edit (its
// InlineCompletionsDebounce; a stable extension cannot shorten it), so the
// request the provider would send for a typed character is sent as soon as
// the edit is heard of (workspace.onDidChangeTextDocument), and the provider's
// call for that very document version and cursor awaits it instead of sending
// another. Only plain typing at one cursor qualifies; anything else (undo,
// several cursors, a line break, text typed over a selection) takes the
// provider's own path. No vscode API beyond the change event's shape.

import type { Place } from './cache';
import type { PendingCompletion } from './client';
import type { Alternative } from './tracker';

/** How a request ended, for the provider: what to show (none when it failed or was cancelled), and whether the cache kept it. */
export interface Answer {
  id: string;
  alternatives: Alternative[];
  kept: boolean;
}

/** What of a `TextDocumentChangeEvent` is looked at (a structural subset: the tests' fake has it too). */
export interface DocumentEdit {
  contentChanges: readonly { rangeOffset: number; rangeLength: number; text: string }[];
  /** Set (Undo, Redo) when the edit is no keystroke. */
  reason?: unknown;
}

/** What VS Code inserts when an opening bracket or quote is typed and it closes the pair (editor.autoClosingBrackets, editor.autoClosingQuotes). */
const AUTO_CLOSED = new Set(['()', '[]', '{}', '""', "''", '``']);

/**
 * The cursor offset after `edit` when it is a keystroke at one cursor: one
 * change, not an undo or redo, that inserts text without a line break where
 * nothing was selected (the cursor after it; between the two when it is an
 * auto-closed pair, `(` typed and `)` added), or deletes within a line
 * (Backspace, Delete: the cursor where the deleted text began). Undefined
 * otherwise. (Where the guess is wrong, a pasted `()`, the provider's call
 * matches no request sent here and asks itself.)
 */
export function typedCursor(edit: DocumentEdit): number | undefined {
  if (edit.reason !== undefined || edit.contentChanges.length !== 1) {
    return undefined;
  }
  const [change] = edit.contentChanges;
  if (change.text !== '') {
    if (change.rangeLength !== 0 || /[\r\n]/.test(change.text)) {
      return undefined;
    }
    return change.rangeOffset + (AUTO_CLOSED.has(change.text) ? 1 : change.text.length);
  }
  return change.rangeLength > 0 ? change.rangeOffset : undefined;
}

/** A request sent at a keystroke, for the state of the document it left. */
export interface EarlyRequest {
  uri: string;
  version: number;
  cursor: number;
  place: Place;
  pending: PendingCompletion;
  /** Its end, already cached (the user may come back to the place), the server's hold noted. */
  answer: Promise<Answer | undefined>;
}

/**
 * The request sent at the last keystroke, until the provider's call for the
 * same document version and cursor takes it. A newer keystroke in the same
 * document cancels one not taken (a taken one is the provider call's, which
 * VS Code cancels itself).
 */
export class EarlyRequests {
  private waiting: EarlyRequest | undefined;

  /** `unused`: a request no provider call took, cancelled (its answer may have come already). */
  constructor(private readonly unused: (request: EarlyRequest) => void = () => undefined) {}

  /** A keystroke in `uri`: the request sent at an earlier one there is for a state gone. */
  typedIn(uri: string): void {
    if (this.waiting?.uri === uri) {
      this.drop();
    }
  }

  sent(request: EarlyRequest): void {
    this.drop(); // (in another document: typing moved there)
    this.waiting = request;
  }

  /** The request sent for exactly this state (then no longer waiting), if any. */
  take(uri: string, version: number, cursor: number): EarlyRequest | undefined {
    const w = this.waiting;
    if (!w || w.uri !== uri || w.version !== version || w.cursor !== cursor) {
      return undefined;
    }
    this.waiting = undefined;
    return w;
  }

  /** The request waiting, if any, cancelled: completions or this way of asking turned off. */
  drop(): void {
    const w = this.waiting;
    this.waiting = undefined;
    if (w) {
      w.pending.cancel();
      this.unused(w);
    }
  }
}
