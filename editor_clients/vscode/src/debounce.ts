// How long to wait after a keystroke before asking for a completion: about
// one of the user's usual keystroke gaps (so a burst of typing sends nothing),
// shortened by half the recent latency (a slow answer is started sooner),
// clamped to [minMs, maxMs]. Both averages are exponential moving averages.

export interface DebounceRange {
  minMs: number;
  maxMs: number;
}

/** Gaps longer than this are pauses, not the typing rhythm. */
const PAUSE_MS = 1000;
const ALPHA = 0.3;
const GAP_FACTOR = 1.5;
const LATENCY_FACTOR = 0.5;

export class AdaptiveDebounce {
  private gapEma: number | undefined;
  private latencyEma: number | undefined;
  private lastKeystroke: number | undefined;

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

  /** A completed request's latency (send to done), in ms. */
  latency(ms: number): void {
    this.latencyEma = this.latencyEma === undefined ? ms : ALPHA * ms + (1 - ALPHA) * this.latencyEma;
  }

  get typingGapMs(): number | undefined {
    return this.gapEma;
  }

  get latencyMs(): number | undefined {
    return this.latencyEma;
  }

  /** The wait before the next request, in ms. */
  delayMs(): number {
    const { minMs, maxMs } = this.range;
    const lo = Math.max(0, Math.min(minMs, maxMs));
    const hi = Math.max(lo, maxMs);
    if (this.gapEma === undefined) {
      return (lo + hi) / 2;
    }
    const wanted = GAP_FACTOR * this.gapEma - LATENCY_FACTOR * (this.latencyEma ?? 0);
    return Math.round(Math.min(hi, Math.max(lo, wanted)));
  }
}
