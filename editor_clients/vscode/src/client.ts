// The completer protocol (version 1, /work/shared/PROTOCOL.md) over one
// WebSocket, with reconnection. Independent of the vscode API: the provider
// and the tests drive it the same way.

import { EventEmitter } from 'events';
import WebSocket from 'ws';

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

export interface ContextItem {
  uri: string;
  text: string;
}

/** A `complete` without its `type` and `id` (the client assigns the id). */
export interface CompleteParams {
  document: DocumentState;
  context?: ContextItem[];
  mode?: Mode;
  max_tokens?: number;
  temperature?: number;
  stop?: string[];
  deadline_ms?: number;
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
}

/**
 * How a request ended. `reason` is the server's `done.reason`, `error` when it
 * answered with an `error`, or `disconnected` when the connection went away
 * before a terminal message arrived.
 */
export interface CompletionResult {
  id: string;
  reason: DoneReason | 'error' | 'disconnected';
  /** `done.text`; on error or disconnect, the deltas received so far. */
  text: string;
  /** Every delta's text, in order. */
  deltas: string[];
  timings?: Timings;
  error?: { code: string; message: string };
  /** Client-side: from sending `complete` to its terminal message. */
  latencyMs: number;
  /** Whether this client asked for it to end (cancel, or a newer request superseded it). */
  cancelRequested: boolean;
}

export interface PendingCompletion {
  readonly id: string;
  readonly result: Promise<CompletionResult>;
  /** Send `cancel` (once; not when a newer request for the same uri already superseded it). */
  cancel(): void;
}

export type ConnectionState = 'stopped' | 'connecting' | 'connected' | 'disconnected';

export interface StateChange {
  state: ConnectionState;
  /** Why the last attempt failed or the connection closed (empty when connected). */
  detail: string;
  /** For `disconnected`: when the next attempt starts. */
  retryInMs?: number;
  /** Consecutive failed attempts since the last successful connection. */
  failures: number;
  /** The HTTP status that refused the last upgrade (401: wrong token, 503: loading). */
  httpStatus?: number;
}

export interface ClientOptions {
  url: string;
  /** Read on every connection attempt, so a token file written later is picked up. */
  token: () => string | undefined;
  clientName?: string;
  initialBackoffMs?: number;
  maxBackoffMs?: number;
  handshakeTimeoutMs?: number;
}

export class NotConnectedError extends Error {
  constructor() {
    super('not connected to the completer server');
    this.name = 'NotConnectedError';
  }
}

interface InFlight {
  id: string;
  uri: string;
  deltas: string[];
  sentAt: number;
  cancelRequested: boolean;
  superseded: boolean;
  onDelta?: (text: string) => void;
  resolve: (result: CompletionResult) => void;
}

/**
 * Events: `state` (StateChange), `sent` (the message object, after sending),
 * `message` (each server message), `result` (CompletionResult), `ready` (ServerInfo),
 * `log` (string).
 */
export class CompleterClient extends EventEmitter {
  private opts: Required<Omit<ClientOptions, 'token'>> & Pick<ClientOptions, 'token'>;
  private ws: WebSocket | undefined;
  private _state: ConnectionState = 'stopped';
  private detail = '';
  private failures = 0;
  private httpStatus: number | undefined;
  private retryTimer: NodeJS.Timeout | undefined;
  private nextId = 1;
  private inflight = new Map<string, InFlight>();
  private inflightByUri = new Map<string, string>();
  /** Set on `ready`. */
  server: ServerInfo | undefined;

  constructor(options: ClientOptions) {
    super();
    this.opts = {
      clientName: 'vscode/0.1.0',
      initialBackoffMs: 250,
      maxBackoffMs: 10_000,
      handshakeTimeoutMs: 5_000,
      ...options,
    };
  }

  get state(): ConnectionState {
    return this._state;
  }

  get connected(): boolean {
    return this._state === 'connected';
  }

  get url(): string {
    return this.opts.url;
  }

  /** Connect (and keep reconnecting) until `stop()`. */
  start(): void {
    if (this._state !== 'stopped') {
      return;
    }
    this.failures = 0;
    this.connect();
  }

  /** Close the connection and stop reconnecting; requests in flight end as `disconnected`. */
  stop(): void {
    this.clearRetry();
    const ws = this.ws;
    this.ws = undefined;
    if (ws) {
      ws.removeAllListeners();
      ws.on('error', () => undefined);
      ws.terminate();
    }
    this.failAll('client stopped');
    this.setState('stopped', '');
  }

  /** New url or token source: reconnect now if running. */
  reconfigure(options: Partial<ClientOptions>): void {
    this.opts = { ...this.opts, ...options };
    if (this._state !== 'stopped') {
      this.stop();
      this.start();
    }
  }

  dispose(): void {
    this.stop();
    this.removeAllListeners();
  }

  /**
   * Send a `complete`. Throws NotConnectedError when not connected (the
   * caller shows nothing; it does not queue). A newer request for the same
   * `document.uri` supersedes this one on the server.
   */
  complete(params: CompleteParams, onDelta?: (text: string) => void): PendingCompletion {
    const ws = this.ws;
    if (!ws || this._state !== 'connected' || ws.readyState !== WebSocket.OPEN) {
      throw new NotConnectedError();
    }
    const id = String(this.nextId++);
    const uri = params.document.uri;
    const previous = this.inflightByUri.get(uri);
    if (previous !== undefined) {
      const old = this.inflight.get(previous);
      if (old) {
        old.superseded = true; // the server ends it with `cancelled`; no `cancel` needed
        old.cancelRequested = true;
      }
    }
    let resolve!: (r: CompletionResult) => void;
    const result = new Promise<CompletionResult>((r) => (resolve = r));
    const entry: InFlight = {
      id, uri, deltas: [], sentAt: performance.now(), cancelRequested: false, superseded: false, onDelta, resolve,
    };
    this.inflight.set(id, entry);
    this.inflightByUri.set(uri, id);
    this.send({ type: 'complete', id, ...params });
    return {
      id,
      result,
      cancel: () => {
        if (entry.cancelRequested || !this.inflight.has(id)) {
          return;
        }
        entry.cancelRequested = true;
        this.send({ type: 'cancel', id });
      },
    };
  }

  /** Report what the user did with completion `id` (0 = dismissed). */
  feedback(id: string, acceptedChars: number): void {
    if (this._state === 'connected') {
      this.send({ type: 'feedback', id, accepted_chars: Math.max(0, Math.round(acceptedChars)) });
    }
  }

  // -- connection ------------------------------------------------------------

  private connect(): void {
    this.clearRetry();
    this.setState('connecting', this.detail);
    const token = this.opts.token();
    const headers: Record<string, string> = {};
    if (token) {
      headers.Authorization = `Bearer ${token}`;
    }
    let ws: WebSocket;
    try {
      ws = new WebSocket(this.opts.url, {
        headers,
        handshakeTimeout: this.opts.handshakeTimeoutMs,
        perMessageDeflate: false,
      });
    } catch (e) {
      this.onClosed(`bad url ${this.opts.url}: ${(e as Error).message}`);
      return;
    }
    this.ws = ws;
    let failure = '';
    this.httpStatus = undefined;
    ws.on('unexpected-response', (_req, res) => {
      const code = res.statusCode ?? 0;
      this.httpStatus = code;
      failure = code === 401 ? 'the server refused the token (HTTP 401)'
        : code === 503 ? 'the server is loading its models (HTTP 503)'
          : `the server answered HTTP ${code}`;
      res.resume();
      ws.terminate();
    });
    ws.on('open', () => {
      this.failures = 0;
      this.send({ type: 'hello', client: this.opts.clientName, protocol: PROTOCOL_VERSION });
      this.setState('connected', '');
    });
    ws.on('message', (data, isBinary) => {
      if (!isBinary) {
        const buf = Buffer.isBuffer(data) ? data : Array.isArray(data) ? Buffer.concat(data) : Buffer.from(new Uint8Array(data));
        this.onMessage(buf.toString('utf8'));
      }
    });
    ws.on('error', (err) => {
      if (!failure) {
        failure = describeError(err);
      }
    });
    ws.on('close', (code) => {
      if (this.ws !== ws) {
        return;
      }
      this.ws = undefined;
      this.onClosed(failure || `connection closed (${code})`);
    });
  }

  private onClosed(detail: string): void {
    this.failAll(detail);
    this.failures += 1;
    const base = Math.min(this.opts.maxBackoffMs, this.opts.initialBackoffMs * 2 ** (this.failures - 1));
    const delay = Math.round(Math.min(this.opts.maxBackoffMs, base * (0.8 + 0.4 * Math.random())));
    this.emit('log', `${this.opts.url}: ${detail}; retrying in ${delay} ms`);
    this.setState('disconnected', detail, delay);
    this.retryTimer = setTimeout(() => {
      this.retryTimer = undefined;
      this.connect();
    }, delay);
  }

  private clearRetry(): void {
    if (this.retryTimer) {
      clearTimeout(this.retryTimer);
      this.retryTimer = undefined;
    }
  }

  private setState(state: ConnectionState, detail: string, retryInMs?: number): void {
    this._state = state;
    this.detail = detail;
    const change: StateChange = { state, detail, failures: this.failures };
    if (retryInMs !== undefined) {
      change.retryInMs = retryInMs;
    }
    if (state === 'disconnected' && this.httpStatus !== undefined) {
      change.httpStatus = this.httpStatus;
    }
    this.emit('state', change);
  }

  private send(message: Record<string, unknown>): void {
    const ws = this.ws;
    if (!ws || ws.readyState !== WebSocket.OPEN) {
      return;
    }
    ws.send(JSON.stringify(message));
    this.emit('sent', message);
  }

  private failAll(detail: string): void {
    for (const entry of [...this.inflight.values()]) {
      this.finish(entry, { reason: 'disconnected', text: entry.deltas.join(''), error: { code: 'disconnected', message: detail } });
    }
  }

  private finish(entry: InFlight, end: Pick<CompletionResult, 'reason' | 'text'> & Partial<CompletionResult>): void {
    this.inflight.delete(entry.id);
    if (this.inflightByUri.get(entry.uri) === entry.id) {
      this.inflightByUri.delete(entry.uri);
    }
    const result: CompletionResult = {
      id: entry.id,
      deltas: entry.deltas,
      latencyMs: performance.now() - entry.sentAt,
      cancelRequested: entry.cancelRequested,
      ...end,
    };
    this.emit('result', result);
    entry.resolve(result);
  }

  private onMessage(frame: string): void {
    let msg: Record<string, unknown>;
    try {
      msg = JSON.parse(frame) as Record<string, unknown>;
    } catch {
      this.emit('log', `unreadable frame from the server: ${frame.slice(0, 200)}`);
      return;
    }
    if (typeof msg !== 'object' || msg === null) {
      return;
    }
    this.emit('message', msg);
    const id = typeof msg.id === 'string' ? msg.id : undefined;
    const entry = id !== undefined ? this.inflight.get(id) : undefined;
    switch (msg.type) {
      case 'ready':
        this.server = msg as unknown as ServerInfo;
        this.emit('ready', this.server);
        break;
      case 'delta':
        if (entry && typeof msg.text === 'string') {
          entry.deltas.push(msg.text);
          entry.onDelta?.(msg.text);
        }
        break;
      case 'done':
        if (entry) {
          this.finish(entry, {
            reason: msg.reason as DoneReason,
            text: typeof msg.text === 'string' ? msg.text : entry.deltas.join(''),
            timings: msg.timings as Timings | undefined,
          });
        }
        break;
      case 'error': {
        const error = { code: String(msg.code), message: String(msg.message) };
        if (entry) {
          this.finish(entry, { reason: 'error', text: entry.deltas.join(''), error });
        } else {
          this.emit('log', `server error: ${error.code}: ${error.message}`);
        }
        break;
      }
      default:
        break; // newer message types are ignored (forward compatible)
    }
  }
}

function describeError(err: Error & { code?: string }): string {
  if (err.code === 'ECONNREFUSED') {
    return 'connection refused (is `completer serve` running?)';
  }
  return err.message || String(err);
}
