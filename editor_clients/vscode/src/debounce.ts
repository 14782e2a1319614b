// How long to wait after a keystroke before asking for a completion. A warm
// keystroke costs the server a few tokens and a superseded request is
// cancelled at once (its prefill reused by the next), so the client asks at
// once, as llama.vim does, and waits only when the server says so: its last
// `done` carried `hold_ms` (server.client_hold: other editors share a loaded
// engine), followed for HOLD_FRESH_MS. Clamped to [minMs, maxMs] (the same
// value for both: a fixed wait). The Neovim plugin's debounce.lua is the same
// rule.

export interface DebounceRange {
  minMs: number;
  maxMs: number;
}

const HOLD_FRESH_MS = 3000;

export class AdaptiveDebounce {
  private held: { ms: number; at: number } | undefined;

  constructor(private range: DebounceRange) {}

  setRange(range: DebounceRange): void {
    this.range = range;
  }

  /** The server's `done.hold_ms`, received at `now` ms. */
  hold(ms: number, now: number): void {
    this.held = { ms, at: now };
  }

  get holdMs(): number | undefined {
    return this.held?.ms;
  }

  /** The wait before the next request at `now` ms. */
  delayMs(now: number): number {
    const { minMs, maxMs } = this.range;
    const lo = Math.max(0, Math.min(minMs, maxMs));
    const hi = Math.max(lo, maxMs);
    const wanted = this.held && now - this.held.at <= HOLD_FRESH_MS ? this.held.ms : 0;
    return Math.round(Math.min(hi, Math.max(lo, wanted)));
  }
}
