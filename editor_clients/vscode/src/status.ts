// The status bar item: off / connecting / offline / generating (a spinner
// while a suggestion is on its way) / connected with the last latency / the
// last request's error. Never a popup.

import * as vscode from 'vscode';

import type { StateChange } from './client';

export const STATS_COMMAND = 'completer.showStats';

export interface StatusView {
  enabled: boolean;
  url: string;
  connection: StateChange;
  lastLatencyMs?: number;
  /** The last request's error, cleared by the next request that ends well. */
  error?: { code: string; message: string };
  model?: string;
  /** A request for a suggestion is in flight (not cancelled): the spinner. */
  generating?: boolean;
}

/** The codicon the item spins while a suggestion is generated. */
export const GENERATING_ICON = '$(loading~spin)';

export class StatusBar implements vscode.Disposable {
  readonly item: vscode.StatusBarItem;

  constructor() {
    this.item = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Right, 100);
    this.item.name = 'completer';
    this.item.command = STATS_COMMAND;
    this.item.show();
  }

  update(v: StatusView): void {
    const item = this.item;
    item.backgroundColor = undefined;
    if (!v.enabled) {
      item.text = '$(circle-slash) completer: off';
      item.tooltip = 'completer: completions are off (command "Completer: Toggle Completions")';
      return;
    }
    const c = v.connection;
    if (c.state === 'connected') {
      if (v.generating) {
        item.text = `${GENERATING_ICON} completer`;
        item.tooltip = `completer: generating a suggestion (${v.url}${v.model ? `, ${v.model}` : ''})`;
        return;
      }
      if (v.error) {
        item.text = '$(warning) completer: error';
        item.tooltip = `completer: the last request failed: ${v.error.code}: ${v.error.message}`;
        item.backgroundColor = new vscode.ThemeColor('statusBarItem.warningBackground');
        return;
      }
      item.text = v.lastLatencyMs === undefined ? '$(zap) completer' : `$(zap) completer ${Math.round(v.lastLatencyMs)} ms`;
      item.tooltip = `completer: connected to ${v.url}${v.model ? ` (${v.model})` : ''}`
        + `${v.lastLatencyMs === undefined ? '' : `; last latency ${Math.round(v.lastLatencyMs)} ms`}. Click for stats.`;
      return;
    }
    if (c.state === 'connecting' && c.failures === 0) {
      item.text = '$(sync~spin) completer';
      item.tooltip = `completer: connecting to ${v.url}`;
      return;
    }
    item.text = '$(debug-disconnect) completer: offline';
    const retry = c.retryInMs !== undefined ? `; retrying in ${(c.retryInMs / 1000).toFixed(1)} s` : '; retrying';
    item.tooltip = `completer: not connected to ${v.url}${c.detail ? `: ${c.detail}` : ''}${retry}`
      + ` (${c.failures} failed attempt${c.failures === 1 ? '' : 's'})`;
  }

  dispose(): void {
    this.item.dispose();
  }
}
