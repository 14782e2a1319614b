// Recent completions by where they were asked for, least recently used out
// first (as llama.vscode and Tabby keep them): backspacing to a place seen
// before, or coming back to it, shows its completion again without a request.
//
// A place is keyed by the document's text up to the start of the cursor's
// line and everything after the cursor (hashed), then the cursor line's text
// before the cursor. Typing on that line changes only the last part, so one
// lookup also finds a completion asked for a few characters back whose text
// goes on with what was typed since. No vscode API.

import { createHash } from 'crypto';

import type { Alternative } from './tracker';

export interface Place {
  uri: string;
  /** The document before the cursor, and after it. */
  prefix: string;
  suffix: string;
}

export interface CachedCompletion {
  id: string;
  /** `done.text` (index 0) and `done.candidates`. */
  alternatives: Alternative[];
}

export interface CacheHit extends CachedCompletion {
  /** What was typed on the line since the completion was asked for (already in the document). */
  typed: string;
}

interface Entry extends CachedCompletion {
  anchor: string;
  line: string;
}

/** Typed this many characters past where a completion was asked for, it is no longer looked for. */
const MAX_TYPED_AHEAD = 256;

export class CompletionCache {
  private entries = new Map<string, Entry>(); // by anchor + line; Map order is use order, oldest first

  constructor(private capacity: number, private readonly evicted: (entry: CachedCompletion) => void = () => undefined) {}

  setCapacity(capacity: number): void {
    this.capacity = Math.max(0, Math.floor(capacity));
    this.trim();
  }

  get size(): number {
    return this.entries.size;
  }

  /** Keep `completion` for `place`; false when it is not kept (the cache is off, or it is empty). */
  put(place: Place, completion: CachedCompletion): boolean {
    const alternatives = completion.alternatives.filter((a) => a.text.length > 0);
    if (this.capacity <= 0 || alternatives.length === 0) {
      return false;
    }
    const { anchor, line } = split(place);
    const key = `${anchor}\n${line}`;
    const old = this.entries.get(key);
    this.entries.delete(key);
    if (old && old.id !== completion.id) {
      this.evicted(old);
    }
    this.entries.set(key, { ...completion, alternatives, anchor, line });
    this.trim();
    return true;
  }

  /**
   * The completion for `place`: one asked for exactly here, else the most
   * recent one asked for earlier on this line whose text begins with what
   * was typed since. Its alternatives are cut to what is left to insert.
   */
  get(place: Place): CacheHit | undefined {
    if (this.entries.size === 0) {
      return undefined;
    }
    const { anchor, line } = split(place);
    for (let back = 0; back <= Math.min(line.length, MAX_TYPED_AHEAD); back++) {
      const key = `${anchor}\n${line.slice(0, line.length - back)}`;
      const entry = this.entries.get(key);
      if (!entry) {
        continue;
      }
      const typed = line.slice(line.length - back);
      const alternatives = entry.alternatives
        .filter((a) => a.text.length > typed.length && a.text.startsWith(typed))
        .map((a) => ({ index: a.index, text: a.text.slice(typed.length) }));
      if (alternatives.length > 0) {
        this.entries.delete(key); // most recently used now
        this.entries.set(key, entry);
        return { id: entry.id, alternatives, typed };
      }
    }
    return undefined;
  }

  clear(): void {
    this.entries.clear();
  }

  private trim(): void {
    while (this.entries.size > this.capacity) {
      const [key, oldest] = this.entries.entries().next().value as [string, Entry];
      this.entries.delete(key);
      this.evicted(oldest);
    }
  }
}

function split(place: Place): { anchor: string; line: string } {
  const lineStart = place.prefix.lastIndexOf('\n') + 1;
  const hash = createHash('sha1');
  hash.update(place.uri);
  hash.update('\0');
  hash.update(place.prefix.slice(0, lineStart));
  hash.update('\0');
  hash.update(place.suffix);
  return { anchor: hash.digest('hex'), line: place.prefix.slice(lineStart) };
}
