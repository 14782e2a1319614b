// Whether an open WebSocket still reaches the server. A connection can die
// without a close: the machine slept, a tunnel or NAT dropped it, the server
// froze. TCP then reports nothing for minutes while every request waits. The
// server pings each connection every 20 s (server.keepalive_s in
// completer/config/server.py), so a healthy one is never silent for much longer;
// after `silenceMs` without a frame, a ping, or a pong, or whenever a request
// overran its deadline, we ping it ourselves, and no pong within
// `pongTimeoutMs` means dead. Times are wall-clock (Date.now), so a suspend
// counts as silence: the first check after resume probes at once.

/** The server's ping interval (s) plus a margin for a loaded server. */
export const DEFAULT_SILENCE_MS = 25_000;
export const DEFAULT_PONG_TIMEOUT_MS = 5_000;

export interface LivenessOptions {
  silenceMs: number;
  pongTimeoutMs: number;
  /** Send a ping frame. */
  ping: () => void;
  /** The connection is dead (called once). */
  dead: (detail: string) => void;
  now?: () => number;
}

export class Liveness {
  private lastHeard: number;
  private probeSince: number | undefined;
  private timer: NodeJS.Timeout | undefined;
  private over = false;

  constructor(private readonly opts: LivenessOptions) {
    this.lastHeard = this.now();
    // Checked often enough to notice a missing pong near its timeout, and at least once a second.
    const every = Math.max(50, Math.min(1000, opts.pongTimeoutMs / 4, opts.silenceMs / 4));
    this.timer = setInterval(() => this.check(), every);
    this.timer.unref?.(); // never what keeps a process (the tests') alive
  }

  /** Anything arrived from the server: a frame, a ping, a pong. */
  heard(): void {
    this.lastHeard = this.now();
    this.probeSince = undefined;
  }

  /** Ping now (unless a ping already waits for its pong): a request overran its deadline. */
  probe(): void {
    if (this.over || this.probeSince !== undefined) {
      return;
    }
    this.probeSince = this.now();
    try {
      this.opts.ping();
    } catch {
      this.declareDead('the connection failed while pinging the server');
    }
  }

  stop(): void {
    this.over = true;
    if (this.timer) {
      clearInterval(this.timer);
      this.timer = undefined;
    }
  }

  private check(): void {
    const now = this.now();
    if (this.probeSince !== undefined) {
      if (now - this.probeSince >= this.opts.pongTimeoutMs) {
        this.declareDead(`no answer from the server for ${Math.round((now - this.lastHeard) / 1000)} s `
          + `(a ping got no pong within ${this.opts.pongTimeoutMs} ms)`);
      }
    } else if (now - this.lastHeard >= this.opts.silenceMs) {
      this.probe();
    }
  }

  private declareDead(detail: string): void {
    if (this.over) {
      return;
    }
    this.stop();
    this.opts.dead(detail);
  }

  private now(): number {
    return (this.opts.now ?? Date.now)();
  }
}
