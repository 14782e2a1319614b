// The extension's settings (contributes.configuration in package.json).

import * as vscode from 'vscode';

export interface Settings {
  enabled: boolean;
  serverUrl: string;
  token: string;
  tokenFile: string;
  debounceMinMs: number;
  debounceMaxMs: number;
  maxTokens: number;
  deadlineMs: number;
  contextMaxSnippets: number;
  contextMaxChars: number;
  reconnectMaxDelayMs: number;
}

export const SECTION = 'completer';

export function readSettings(): Settings {
  const c = vscode.workspace.getConfiguration(SECTION);
  const num = (key: string, fallback: number, min = 0): number => {
    const v = c.get<number>(key, fallback);
    return typeof v === 'number' && Number.isFinite(v) ? Math.max(min, v) : fallback;
  };
  return {
    enabled: c.get<boolean>('enabled', true) !== false,
    serverUrl: c.get<string>('serverUrl', 'ws://127.0.0.1:8750/v1/ws') || 'ws://127.0.0.1:8750/v1/ws',
    token: c.get<string>('token', '') ?? '',
    tokenFile: c.get<string>('tokenFile', '') ?? '',
    debounceMinMs: num('debounce.minMs', 30),
    debounceMaxMs: num('debounce.maxMs', 300),
    maxTokens: num('maxTokens', 0),
    deadlineMs: num('deadlineMs', 0),
    contextMaxSnippets: num('context.maxSnippets', 3),
    contextMaxChars: num('context.maxChars', 1500),
    reconnectMaxDelayMs: num('reconnect.maxDelayMs', 10_000, 100),
  };
}
