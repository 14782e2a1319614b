// The messages of the completer protocol (version 1, docs/protocol.md) as the
// client sends and reads them. Types only, plus the one rule about counting
// characters that both ends must agree on.

export const PROTOCOL_VERSION = 1;

export type Mode = 'line' | 'block' | 'free';
export type DoneReason = 'stop' | 'length' | 'eos' | 'cancelled' | 'deadline';
export type ErrorCode = 'bad_request' | 'unsupported' | 'too_large' | 'overloaded' | 'internal';

export interface DocumentState {
  uri: string;
  language: string;
  prefix: string;
  suffix: string;
}

/** Where a context item came from; the server ranks definitions and recent edits a little ahead. */
export type ContextKind = '' | 'open' | 'visited' | 'edit' | 'yank' | 'definition';

export interface ContextItem {
  uri: string;
  text: string;
  kind?: ContextKind;
}

/** A `complete` without its `type` and `id` (the client assigns the id). */
export interface CompleteParams {
  document: DocumentState;
  context?: ContextItem[];
  mode?: Mode;
  /** 0 asks only to prefill (prime the server's cache); `done` then has text "". */
  max_tokens?: number;
  temperature?: number;
  stop?: string[];
  deadline_ms?: number;
  /** false: neither replaces the request in flight for this document nor is replaced by a later one. */
  supersede?: boolean;
  /** How many completions (1..4); the others arrive as `done.candidates`. */
  n?: number;
  /** The root folder URI of the workspace the document belongs to: the server keeps each one's files apart. */
  workspace?: string;
  /** The confidence rules (probabilities, 0 to 1; left out: the server's defaults; 0: off). */
  min_first_prob?: number;
  min_token_prob?: number;
  min_line_prob?: number;
}

export interface Timings {
  queue_ms: number;
  ttft_ms: number;
  total_ms: number;
  prompt_tokens: number;
  cached_tokens: number;
  generated_tokens: number;
  draft_proposed: number;
  draft_accepted: number;
  prefill: string;
  [key: string]: unknown;
}

export interface ServerInfo {
  protocol: number;
  server: string;
  model: { target: string; draft?: string | null };
  /** What a request that leaves them out gets (servers before it send none). */
  request?: { deadline_ms?: number; max_tokens?: number; first_deadline_ms?: number };
}

/** Why the extension sent a request: it decides what the result is used for and what it may show. */
export type RequestPurpose = 'complete' | 'prime' | 'speculative';

/**
 * How a request ended. `reason` is the server's `done.reason`, `error` when it
 * answered with an `error`, `disconnected` when the connection went away
 * before a terminal message arrived, or `timeout` when none arrived by the
 * request's deadline plus a margin (the client gave up on it).
 */
export interface CompletionResult {
  id: string;
  reason: DoneReason | 'error' | 'disconnected' | 'timeout';
  /** `done.text`; on error, disconnect or timeout, the deltas received so far. */
  text: string;
  /** `done.candidates`: the other completions asked for with `n` (none from a server without them). */
  candidates: string[];
  /** Every delta's text, in order. */
  deltas: string[];
  timings?: Timings;
  error?: { code: string; message: string };
  /** Client-side: from sending `complete` to its terminal message. */
  latencyMs: number;
  /** `done.hold_ms`: how long the server asks the client to wait after a keystroke (absent: it does not say). */
  holdMs?: number;
  /** Whether this client asked for it to end (cancel, or a newer request superseded it). */
  cancelRequested: boolean;
  purpose: RequestPurpose;
}

/**
 * Characters as the server counts them (Unicode code points, Python's `len`),
 * between two UTF-16 offsets of `text`. Additive: a range that ends inside a
 * surrogate pair counts the pair once, in the range holding its first half,
 * so the counts of adjacent ranges add up to the count of the whole.
 */
export function codePointsBetween(text: string, start: number, end: number): number {
  let n = 0;
  for (let i = Math.max(0, start); i < Math.min(end, text.length); i++) {
    const unit = text.charCodeAt(i);
    if (unit < 0xdc00 || unit > 0xdfff || i === 0 || !isHighSurrogate(text.charCodeAt(i - 1))) {
      n += 1; // a low surrogate after a high one is the same character
    }
  }
  return n;
}

export function codePoints(text: string): number {
  return codePointsBetween(text, 0, text.length);
}

function isHighSurrogate(unit: number): boolean {
  return unit >= 0xd800 && unit <= 0xdbff;
}
