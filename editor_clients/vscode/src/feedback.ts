// One `feedback` per completion, whatever became of it: shown and then kept
// (accepted or typed through) or dismissed, or never shown at all (it came
// after the user moved on, or was fetched ahead and never needed). A
// completion the cache shows again after its feedback went is not reported
// twice: the server has forgotten it. No vscode API.

import type { FeedbackReport } from './client';
import { keptChars, Shown } from './tracker';

/** Ids remembered as reported; the server forgets its own after 1024. */
const REMEMBERED = 4096;

export class FeedbackLedger {
  private reported = new Set<string>();
  private displayed = new Set<string>();

  constructor(private readonly send: (id: string, report: FeedbackReport) => void) {}

  /** Completion `id` is on screen (from its request or from the cache). */
  markDisplayed(id: string): void {
    remember(this.displayed, id);
  }

  /** A shown suggestion's life ended. */
  finished(shown: Shown): void {
    if (this.reported.has(shown.id)) {
      return;
    }
    remember(this.reported, shown.id);
    const kept = keptChars(shown);
    const candidate = shown.alive[0].index;
    this.send(shown.id, {
      acceptedChars: kept.accepted, typedChars: kept.typed, shown: true, ...(candidate > 0 ? { candidate } : {}),
    });
  }

  /** Completion `id` will not be shown any more (it left the cache, or was never kept): report it if it never was. */
  dropped(id: string): void {
    if (this.reported.has(id) || this.displayed.has(id)) {
      return;
    }
    remember(this.reported, id);
    this.send(id, { acceptedChars: 0, typedChars: 0, shown: false });
  }
}

function remember(set: Set<string>, id: string): void {
  set.add(id);
  if (set.size > REMEMBERED) {
    set.delete(set.values().next().value as string);
  }
}
