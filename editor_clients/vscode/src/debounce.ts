// How long to wait after a keystroke before asking for a completion. A warm
// keystroke costs the server a few tokens and a superseded request is
// cancelled at once, so the client asks at once (as llama.vim does) and waits
// only when the server is busy or slow, never for the user's typing rhythm
// alone:
// - busy: the server's last `done` said `hold_ms` (its requests wait for the
//   engine; server.client_hold), followed for HOLD_FRESH_MS;
// - slow: the server's recent first answers (the median of the last FIRSTS
//   sends to their first delta) take longer than the user's usual gap between
//   keys, so a request sent mid-burst is answered after the next key anyway:
//   then only a pause (GAP_FACTOR gaps) is asked about.
// Clamped to [minMs, maxMs]. The typing gap is an exponential moving average;
// the first answers a median (one long prefill after a jump is not the server
// being slow). The Neovim plugin's debounce.lua is the same rule.

export interface DebounceRange {
  minMs: number;
  maxMs: number;
}

/** Gaps longer than this are pauses, not the typing rhythm. */
const PAUSE_MS = 1000;
const ALPHA = 0.3;
const GAP_FACTOR = 1.5;
const FIRSTS = 8;
const HOLD_FRESH_MS = 3000;

function median(xs: number[]): number | undefined {
  if (xs.length === 0) {
    return undefined;
  }
  const s = [...xs].sort((a, b) => a - b);
  const n = s.length;
  return n % 2 === 1 ? s[(n - 1) / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

export class AdaptiveDebounce {
  private gapEma: number | undefined;
  private lastKeystroke: number | undefined;
  private readonly firsts: number[] = [];
  private held: { ms: number; at: number } | undefined;

  constructor(private range: DebounceRange) {}

  setRange(range: DebounceRange): void {
    this.range = range;
  }

  /** A keystroke (a trigger of the provider) at `now` ms. */
  keystroke(now: number): void {
    if (this.lastKeystroke !== undefined) {
      const gap = now - this.lastKeystroke;
      if (gap > 0 && gap <= PAUSE_MS) {
        this.gapEma = this.gapEma === undefined ? gap : ALPHA * gap + (1 - ALPHA) * this.gapEma;
      }
    }
    this.lastKeystroke = now;
  }

  /** A request's first answer (its first delta, or its end if none came), `ms` after it was sent. */
  firstAnswer(ms: number): void {
    this.firsts.push(ms);
    if (this.firsts.length > FIRSTS) {
      this.firsts.shift();
    }
  }

  /** The server's `done.hold_ms`, received at `now` ms. */
  hold(ms: number, now: number): void {
    this.held = { ms, at: now };
  }

  get typingGapMs(): number | undefined {
    return this.gapEma;
  }

  get firstAnswerMs(): number | undefined {
    return median(this.firsts);
  }

  get holdMs(): number | undefined {
    return this.held?.ms;
  }

  /** The wait before the next request at `now` ms. */
  delayMs(now: number): number {
    const { minMs, maxMs } = this.range;
    const lo = Math.max(0, Math.min(minMs, maxMs));
    const hi = Math.max(lo, maxMs);
    let wanted = this.held && now - this.held.at <= HOLD_FRESH_MS ? this.held.ms : 0;
    const first = this.firstAnswerMs;
    if (first !== undefined && this.gapEma !== undefined && first > this.gapEma) {
      wanted = Math.max(wanted, GAP_FACTOR * this.gapEma);
    }
    return Math.round(Math.min(hi, Math.max(lo, wanted)));
  }
}
