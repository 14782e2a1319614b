// The extension's settings (contributes.configuration in package.json).

import * as vscode from 'vscode';

export interface Settings {
  enabled: boolean;
  serverUrl: string;
  /** Deprecated: moved into the secret storage on start (secrets.ts). */
  token: string;
  tokenFile: string;
  debounceMinMs: number;
  debounceMaxMs: number;
  maxTokens: number;
  deadlineMs: number;
  /** Give a request up this long after it was sent; 0: its deadline (deadlineMs, else the server's) plus 2 s. */
  requestTimeoutMs: number;
  contextEnabled: boolean;
  contextMaxSnippets: number;
  contextMaxChars: number;
  contextDefinitions: number;
  reconnectMaxDelayMs: number;
  /** languageId -> on/off, `*` for the rest. */
  languages: Record<string, boolean>;
  exclude: string[];
  excludeSensitiveFiles: boolean;
  cacheSize: number;
  /** `n`: completions per request, the others offered as alternatives (1..4). */
  candidates: number;
  /** Prefill a document's prompt when it is opened or becomes active. */
  prime: boolean;
  /** Ask for the next line right after a whole suggestion is accepted. */
  speculate: boolean;
  /** Send a typed character's request at the keystroke, not when VS Code asks the provider (50 ms later). */
  requestOnKeystroke: boolean;
}

export const SECTION = 'completer';

export const DEFAULT_LANGUAGES: Record<string, boolean> = { '*': true, plaintext: false, scminput: false };

export function readSettings(): Settings {
  const c = vscode.workspace.getConfiguration(SECTION);
  const num = (key: string, fallback: number, min = 0, max = Infinity): number => {
    const v = c.get<number>(key, fallback);
    return typeof v === 'number' && Number.isFinite(v) ? Math.min(max, Math.max(min, v)) : fallback;
  };
  const bool = (key: string, fallback: boolean): boolean => {
    const v = c.get<boolean>(key, fallback);
    return typeof v === 'boolean' ? v : fallback;
  };
  const languages = c.get<Record<string, boolean>>('languages', DEFAULT_LANGUAGES);
  const exclude = c.get<string[]>('exclude', []);
  return {
    enabled: c.get<boolean>('enabled', true) !== false,
    serverUrl: c.get<string>('serverUrl', 'ws://127.0.0.1:8750/v1/ws') || 'ws://127.0.0.1:8750/v1/ws',
    token: c.get<string>('token', '') ?? '',
    tokenFile: c.get<string>('tokenFile', '') ?? '',
    debounceMinMs: num('debounce.minMs', 0),
    debounceMaxMs: num('debounce.maxMs', 300),
    maxTokens: num('maxTokens', 0),
    deadlineMs: num('deadlineMs', 0),
    requestTimeoutMs: num('requestTimeoutMs', 0),
    contextEnabled: bool('context.enabled', true),
    contextMaxSnippets: num('context.maxSnippets', 4, 0, 64),
    contextMaxChars: num('context.maxChars', 600),
    contextDefinitions: num('context.definitions', 8, 0, 64),
    reconnectMaxDelayMs: num('reconnect.maxDelayMs', 10_000, 100),
    languages: languages && typeof languages === 'object' ? { ...languages } : { ...DEFAULT_LANGUAGES },
    exclude: Array.isArray(exclude) ? exclude.filter((g): g is string => typeof g === 'string') : [],
    excludeSensitiveFiles: bool('excludeSensitiveFiles', true),
    cacheSize: num('cache.size', 128),
    candidates: Math.round(num('candidates', 1, 1, 4)),
    prime: bool('prime', true),
    speculate: bool('speculate', true),
    requestOnKeystroke: bool('requestOnKeystroke', true),
  };
}
