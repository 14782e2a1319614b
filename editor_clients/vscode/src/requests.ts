// The requests in flight on one connection: ids, supersession by document,
// the deadline after which the client stops waiting, and how each one ends
// (CompletionResult). The connection (client.ts) owns the socket and feeds
// this the server's frames.

import { CompleteParams, CompletionResult, DoneReason, RequestPurpose, Timings } from './protocol';

export interface PendingCompletion {
  readonly id: string;
  readonly result: Promise<CompletionResult>;
  /** Send `cancel` (once; not when a newer request for the same uri already superseded it). */
  cancel(): void;
}

export interface RequestOptions {
  onDelta?: (text: string) => void;
  purpose?: RequestPurpose;
}

export interface RequestTimeouts {
  /** A request without `deadline_ms` is given up this long after it was sent (plus the margin), when the server did not say its own. */
  assumedDeadlineMs: number;
  /** The server's default deadline (its `ready`'s `request.deadline_ms`): a request without `deadline_ms` follows it. */
  serverDeadlineMs?: number;
  /**
   * The deadline the server gives a document's first request on the connection when it names none
   * (`ready`'s `request.first_deadline_ms`; the server's default, 15 s, when it says its deadline but not
   * this one): that request prefills the whole document cold.
   */
  serverFirstDeadlineMs?: number;
  /** Given up this long after its deadline, when neither `done` nor `error` came. */
  requestMarginMs: number;
  /** The user's override (`completer.requestTimeoutMs`): every request is given up this long after it was sent; 0 or unset: deadline plus margin. */
  overrideMs?: number;
}

/** The server's `request.first_deadline_ms` when a server that says its deadline does not say this one. */
export const DEFAULT_FIRST_DEADLINE_MS = 15_000;

/**
 * How long to wait for the end of a request: the user's override, else its
 * deadline (its own `deadline_ms`, else the server's default, longer for a
 * document's first request on the connection) plus the margin.
 */
export function requestWaitMs(t: RequestTimeouts, deadlineMs: number | undefined, first: boolean): number {
  if (t.overrideMs !== undefined && t.overrideMs > 0) {
    return t.overrideMs;
  }
  let deadline = deadlineMs;
  if (deadline === undefined) {
    deadline = t.serverDeadlineMs === undefined ? t.assumedDeadlineMs
      : first ? Math.max(t.serverDeadlineMs, t.serverFirstDeadlineMs ?? DEFAULT_FIRST_DEADLINE_MS) : t.serverDeadlineMs;
  }
  return deadline + t.requestMarginMs;
}

interface InFlight {
  id: string;
  uri: string;
  deltas: string[];
  sentAt: number;
  cancelRequested: boolean;
  purpose: RequestPurpose;
  /** Ends the request as `timeout` when its deadline and margin pass without an answer. */
  timer: NodeJS.Timeout;
  onDelta?: (text: string) => void;
  resolve: (result: CompletionResult) => void;
}

export class InFlightRequests {
  private nextId = 1;
  private byId = new Map<string, InFlight>();
  /**
   * The requests of each document that the next one superseding others ends
   * on the server: one, and those sent beside it with `supersede: false`.
   */
  private currentByUri = new Map<string, Set<string>>();
  /** The documents a request was sent for on this connection: the server times a document's first one longer. */
  private sentFor = new Set<string>();

  constructor(
    private readonly send: (message: Record<string, unknown>) => void,
    private readonly ended: (result: CompletionResult) => void,
    /** A request overran its deadline: the connection may be dead. */
    private readonly overran: () => void,
    public timeouts: RequestTimeouts,
    /** How many requests are generating for the user changed (see `generating`). */
    private readonly activity: () => void = () => undefined,
  ) {}

  /**
   * Requests generating a suggestion the user waits for: purpose `complete`,
   * not yet ended, and neither cancelled nor superseded (the user moved on).
   */
  get generating(): number {
    let n = 0;
    for (const entry of this.byId.values()) {
      if (entry.purpose === 'complete' && !entry.cancelRequested) {
        n += 1;
      }
    }
    return n;
  }

  /** Send a `complete` (the connection is open) and track it until its end. */
  add(params: CompleteParams, options: RequestOptions): PendingCompletion {
    const id = String(this.nextId++);
    const uri = params.document.uri;
    const current = this.currentByUri.get(uri) ?? new Set<string>();
    this.currentByUri.set(uri, current);
    if (params.supersede !== false) {
      for (const older of current) {
        const old = this.byId.get(older);
        if (old) {
          old.cancelRequested = true; // the server ends it with `cancelled`; no `cancel` needed
        }
      }
      current.clear();
    }
    let resolve!: (r: CompletionResult) => void;
    const result = new Promise<CompletionResult>((r) => (resolve = r));
    const waitMs = requestWaitMs(this.timeouts, params.deadline_ms, !this.sentFor.has(uri));
    this.sentFor.add(uri);
    const entry: InFlight = {
      id, uri, deltas: [], sentAt: performance.now(), cancelRequested: false,
      purpose: options.purpose ?? 'complete', onDelta: options.onDelta, resolve,
      timer: setTimeout(() => this.timedOut(id, waitMs), waitMs),
    };
    this.byId.set(id, entry);
    current.add(id);
    this.send({ type: 'complete', id, ...params });
    this.activity();
    return {
      id,
      result,
      cancel: () => {
        if (entry.cancelRequested || !this.byId.has(id)) {
          return;
        }
        entry.cancelRequested = true;
        this.send({ type: 'cancel', id });
        this.activity();
      },
    };
  }

  /** A `delta`, `done` or `error` frame from the server. */
  onFrame(msg: Record<string, unknown>): void {
    const entry = typeof msg.id === 'string' ? this.byId.get(msg.id) : undefined;
    if (!entry) {
      return;
    }
    if (msg.type === 'delta' && typeof msg.text === 'string') {
      entry.deltas.push(msg.text);
      entry.onDelta?.(msg.text);
    } else if (msg.type === 'done') {
      this.finish(entry, {
        reason: msg.reason as DoneReason,
        text: typeof msg.text === 'string' ? msg.text : entry.deltas.join(''),
        candidates: Array.isArray(msg.candidates) ? msg.candidates.filter((c): c is string => typeof c === 'string') : [],
        timings: msg.timings as Timings | undefined,
        holdMs: typeof msg.hold_ms === 'number' ? msg.hold_ms : undefined,
      });
    } else if (msg.type === 'error') {
      this.sentFor.delete(entry.uri); // refused before the server took the document in: its next request is its first
      this.finish(entry, {
        reason: 'error', text: entry.deltas.join(''), error: { code: String(msg.code), message: String(msg.message) },
      });
    }
  }

  has(id: string): boolean {
    return this.byId.has(id);
  }

  /** The connection is gone: every request ends as `disconnected`; the next connection's server knows no document. */
  failAll(detail: string): void {
    for (const entry of [...this.byId.values()]) {
      this.finish(entry, { reason: 'disconnected', text: entry.deltas.join(''), error: { code: 'disconnected', message: detail } });
    }
    this.sentFor.clear();
  }

  /**
   * No answer by the deadline and margin: give the request up (the caller
   * waits no longer), tell the server, and have the connection checked, since
   * silence past a deadline is how a dead one shows.
   */
  private timedOut(id: string, waitedMs: number): void {
    const entry = this.byId.get(id);
    if (!entry) {
      return;
    }
    if (!entry.cancelRequested) {
      this.send({ type: 'cancel', id });
    }
    this.finish(entry, {
      reason: 'timeout', text: entry.deltas.join(''),
      error: { code: 'timeout', message: `no answer from the server within ${waitedMs} ms` },
    });
    this.overran();
  }

  private finish(entry: InFlight, end: Pick<CompletionResult, 'reason' | 'text'> & Partial<CompletionResult>): void {
    clearTimeout(entry.timer);
    this.byId.delete(entry.id);
    const current = this.currentByUri.get(entry.uri);
    if (current?.delete(entry.id) && current.size === 0) {
      this.currentByUri.delete(entry.uri);
    }
    const result: CompletionResult = {
      id: entry.id,
      deltas: entry.deltas,
      candidates: [],
      latencyMs: performance.now() - entry.sentAt,
      cancelRequested: entry.cancelRequested,
      purpose: entry.purpose,
      ...end,
    };
    this.ended(result);
    entry.resolve(result);
    this.activity();
  }
}
