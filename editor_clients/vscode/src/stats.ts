// Counters behind the status bar and the "Show Stats" command (no vscode API).

import { codePoints, CompletionResult } from './protocol';
import { FinishHow, keptChars, Shown, shownText } from './tracker';

const LATENCY_WINDOW = 200;

export class Stats {
  requests = 0;
  readonly endings: Record<string, number> = {};
  /** Keystrokes that found no connection (nothing was sent). */
  skippedOffline = 0;
  typeThrough = 0;
  /** Suggestions shown from the cache, without a request. */
  cacheHits = 0;
  shown = 0;
  shownChars = 0;
  acceptedWhole = 0;
  acceptedPartly = 0;
  dismissed = 0;
  /** Characters (code points) inserted by accepting, and typed through. */
  acceptedChars = 0;
  typedChars = 0;
  lastLatencyMs: number | undefined;
  lastError: { code: string; message: string; at: Date } | undefined;
  private latencies: number[] = [];

  request(): void {
    this.requests += 1;
  }

  result(r: CompletionResult): void {
    if (r.purpose === 'prime') {
      return; // no completion: neither a latency nor an ending worth showing
    }
    this.endings[r.reason] = (this.endings[r.reason] ?? 0) + 1;
    if ((r.reason === 'error' || r.reason === 'timeout') && r.error) {
      this.lastError = { ...r.error, at: new Date() };
    } else if (r.reason === 'stop' || r.reason === 'length' || r.reason === 'eos' || r.reason === 'deadline') {
      this.lastLatencyMs = r.latencyMs;
      this.latencies.push(r.latencyMs);
      if (this.latencies.length > LATENCY_WINDOW) {
        this.latencies.shift();
      }
    }
  }

  show(text: string): void {
    this.shown += 1;
    this.shownChars += codePoints(text);
  }

  finished(s: Shown, how: FinishHow): void {
    const kept = keptChars(s);
    this.acceptedChars += kept.accepted;
    this.typedChars += kept.typed;
    if (how === 'accepted' && kept.accepted + kept.typed >= codePoints(shownText(s).slice(s.lead))) {
      this.acceptedWhole += 1;
    } else if (kept.accepted > 0) {
      this.acceptedPartly += 1;
    } else if (how === 'dismissed' || how === 'replaced') {
      this.dismissed += 1;
    }
  }

  percentile(q: number): number | undefined {
    if (this.latencies.length === 0) {
      return undefined;
    }
    const sorted = [...this.latencies].sort((a, b) => a - b);
    return sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
  }

  lines(): string[] {
    const ms = (v: number | undefined) => (v === undefined ? '-' : `${Math.round(v)} ms`);
    const endings = Object.entries(this.endings).map(([k, v]) => `${k} ${v}`).join(', ') || '-';
    const rate = this.shownChars ? `${((100 * this.acceptedChars) / this.shownChars).toFixed(1)}%` : '-';
    return [
      `requests: ${this.requests} (${endings})`,
      `latency: last ${ms(this.lastLatencyMs)}, p50 ${ms(this.percentile(0.5))}, p95 ${ms(this.percentile(0.95))}`,
      `shown: ${this.shown} (${this.shownChars} chars), type-through: ${this.typeThrough}, from the cache: ${this.cacheHits}`,
      `accepted: ${this.acceptedWhole} whole, ${this.acceptedPartly} partly, ${this.dismissed} dismissed; `
        + `${this.acceptedChars} chars (${rate} of shown), ${this.typedChars} typed through`,
      `skipped while offline: ${this.skippedOffline}`,
      `last error: ${this.lastError ? `${this.lastError.code}: ${this.lastError.message}` : '-'}`,
    ];
  }
}
