// The completer protocol (version 1, docs/protocol.md) over one WebSocket,
// with reconnection and a check that the connection still reaches the server
// (liveness.ts); the requests on it are tracked by requests.ts. Independent
// of the vscode API: the provider and the tests drive it the same way.
// (Past ~300 lines: the connection's states, handshake and reconnection
// change together; the requests and liveness are already apart.)

import { EventEmitter } from 'events';
import WebSocket from 'ws';

import { DEFAULT_PONG_TIMEOUT_MS, DEFAULT_SILENCE_MS, Liveness } from './liveness';
import { CompleteParams, PROTOCOL_VERSION, ServerInfo } from './protocol';
import { InFlightRequests, PendingCompletion, RequestOptions, RequestTimeouts } from './requests';

export * from './protocol';
export type { PendingCompletion, RequestOptions } from './requests';

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
  /** Ping the server after this long without hearing from it (liveness.ts). */
  silenceMs?: number;
  /** A ping unanswered this long: the connection is dead. */
  pongTimeoutMs?: number;
  /** A request without `deadline_ms` is given up this long after it was sent (plus the margin), when the server's `ready` did not say its default deadline. */
  assumedDeadlineMs?: number;
  /** Given up this long after its deadline, when neither `done` nor `error` came. */
  requestMarginMs?: number;
  /** The user's override: every request is given up this long after it was sent (0: its deadline plus the margin). */
  requestTimeoutMs?: number;
}

/** What became of a completion (`feedback`). Counts are in code points, as the server counts. */
export interface FeedbackReport {
  acceptedChars: number;
  typedChars: number;
  /** Whether it was on screen at all (false: it came too late, or was fetched ahead and never needed). */
  shown: boolean;
  /** Which text was kept, with `n` > 1: 0 is `done.text`, i is `done.candidates[i - 1]`. */
  candidate?: number;
}

export class NotConnectedError extends Error {
  constructor() {
    super('not connected to the completer server');
    this.name = 'NotConnectedError';
  }
}

/**
 * Events: `state` (StateChange), `sent` (the message object, after sending),
 * `message` (each server message), `result` (CompletionResult), `ready` (ServerInfo),
 * `generating` (the number of requests generating a suggestion, when it may have changed),
 * `log` (string).
 */
export class CompleterClient extends EventEmitter {
  private opts: Required<Omit<ClientOptions, 'token'>> & Pick<ClientOptions, 'token'>;
  private ws: WebSocket | undefined;
  private liveness: Liveness | undefined;
  private _state: ConnectionState = 'stopped';
  private detail = '';
  private failures = 0;
  private httpStatus: number | undefined;
  private retryTimer: NodeJS.Timeout | undefined;
  private readonly requests: InFlightRequests;
  /** Set on `ready`. */
  server: ServerInfo | undefined;

  constructor(options: ClientOptions) {
    super();
    this.opts = {
      clientName: 'vscode/0.1.0',
      initialBackoffMs: 250,
      maxBackoffMs: 10_000,
      handshakeTimeoutMs: 5_000,
      silenceMs: DEFAULT_SILENCE_MS,
      pongTimeoutMs: DEFAULT_PONG_TIMEOUT_MS,
      // For a server that does not say its default deadline (before `ready.request`); an answer
      // later than this is of no use to someone typing.
      assumedDeadlineMs: 10_000,
      requestMarginMs: 2_000,
      requestTimeoutMs: 0,
      ...options,
    };
    this.requests = new InFlightRequests((m) => this.send(m), (r) => this.emit('result', r),
      () => this.liveness?.probe(), this.timeouts(), () => this.emit('generating', this.requests.generating));
  }

  /** Requests in flight generating a suggestion the user waits for (not cancelled, superseded, primes or prefetches). */
  get generating(): number {
    return this.requests.generating;
  }

  /** The wait for a request's end: from the options, and the server's defaults once its `ready` said them. */
  private timeouts(server: ServerInfo | undefined = this.server): RequestTimeouts {
    const positive = (v: unknown) => (typeof v === 'number' && Number.isFinite(v) && v > 0 ? v : undefined);
    return {
      assumedDeadlineMs: this.opts.assumedDeadlineMs,
      requestMarginMs: this.opts.requestMarginMs,
      overrideMs: this.opts.requestTimeoutMs,
      serverDeadlineMs: positive(server?.request?.deadline_ms),
      serverFirstDeadlineMs: positive(server?.request?.first_deadline_ms),
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
    this.dropSocket();
    this.requests.failAll('client stopped');
    this.setState('stopped', '');
  }

  /** New url or token source: reconnect now if running. */
  reconfigure(options: Partial<ClientOptions>): void {
    this.opts = { ...this.opts, ...options };
    this.requests.timeouts = this.timeouts();
    if (this._state !== 'stopped') {
      this.stop();
      this.start();
    }
  }

  /** The user's override of the wait for a request's end (0: deadline plus margin), for requests sent from now on. */
  setRequestTimeout(ms: number): void {
    this.opts.requestTimeoutMs = ms;
    this.requests.timeouts = this.timeouts();
  }

  dispose(): void {
    this.stop();
    this.removeAllListeners();
  }

  /**
   * Send a `complete`. Throws NotConnectedError when not connected (the
   * caller shows nothing; it does not queue). A newer request for the same
   * `document.uri` ends this one on the server, unless the newer one says
   * `supersede: false`. The result comes by the request's deadline plus a
   * margin at the latest (`timeout`).
   */
  complete(params: CompleteParams, options: RequestOptions = {}): PendingCompletion {
    const ws = this.ws;
    if (!ws || this._state !== 'connected' || ws.readyState !== WebSocket.OPEN) {
      throw new NotConnectedError();
    }
    return this.requests.add(params, options);
  }

  /** Report what the user did with completion `id`. */
  feedback(id: string, report: FeedbackReport): void {
    if (this._state === 'connected') {
      this.send({
        type: 'feedback', id,
        accepted_chars: Math.max(0, Math.round(report.acceptedChars)),
        typed_chars: Math.max(0, Math.round(report.typedChars)),
        shown: report.shown,
        ...(report.candidate ? { candidate: report.candidate } : {}),
      });
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
      this.liveness = new Liveness({
        silenceMs: this.opts.silenceMs,
        pongTimeoutMs: this.opts.pongTimeoutMs,
        ping: () => ws.ping(),
        dead: (detail) => {
          if (this.ws === ws) {
            this.dropSocket();
            this.onClosed(detail);
          }
        },
      });
      this.send({ type: 'hello', client: this.opts.clientName, protocol: PROTOCOL_VERSION });
      this.setState('connected', '');
    });
    ws.on('ping', () => this.liveness?.heard());
    ws.on('pong', () => this.liveness?.heard());
    ws.on('message', (data, isBinary) => {
      this.liveness?.heard();
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
      this.stopLiveness();
      this.onClosed(failure || `connection closed (${code})`);
    });
  }

  /** Forget the socket at once and close it, without a close handshake (a dead peer would not answer). */
  private dropSocket(): void {
    this.stopLiveness();
    const ws = this.ws;
    this.ws = undefined;
    if (ws) {
      ws.removeAllListeners();
      ws.on('error', () => undefined);
      ws.terminate();
    }
  }

  private stopLiveness(): void {
    this.liveness?.stop();
    this.liveness = undefined;
  }

  private onClosed(detail: string): void {
    this.requests.failAll(detail);
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
    if (msg.type === 'ready') {
      this.server = msg as unknown as ServerInfo;
      // Requests that leave deadline_ms out are timed by the server's own deadlines (this connection's server).
      this.requests.timeouts = this.timeouts(this.server);
      this.emit('ready', this.server);
    } else if (msg.type === 'error' && (typeof msg.id !== 'string' || !this.requests.has(msg.id))) {
      this.emit('log', `server error: ${String(msg.code)}: ${String(msg.message)}`);
    } else {
      this.requests.onFrame(msg); // delta, done, error of a request; newer message types are ignored
    }
  }
}

function describeError(err: Error & { code?: string }): string {
  if (err.code === 'ECONNREFUSED') {
    return 'connection refused (is `completer serve` running?)';
  }
  return err.message || String(err);
}
