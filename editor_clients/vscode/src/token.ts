// Where `completer serve` keeps its token, and reading it (no vscode API).

import * as fs from 'fs';
import * as os from 'os';
import * as path from 'path';

/** `$XDG_CONFIG_HOME/completer/token`, else `~/.config/completer/token` (as the server). */
export function defaultTokenPath(env: NodeJS.ProcessEnv = process.env): string {
  const base = env.XDG_CONFIG_HOME || path.join(os.homedir(), '.config');
  return path.join(base, 'completer', 'token');
}

export function expandHome(p: string): string {
  return p === '~' || p.startsWith('~/') ? path.join(os.homedir(), p.slice(1)) : p;
}

/**
 * The token to send: the `token` setting when set, else the first line of the
 * token file (the `tokenFile` setting, or the server's default path).
 * Undefined when neither gives one.
 */
export function resolveToken(setting: string, tokenFile: string, env: NodeJS.ProcessEnv = process.env): string | undefined {
  if (setting.trim()) {
    return setting.trim();
  }
  const file = tokenFile.trim() ? expandHome(tokenFile.trim()) : defaultTokenPath(env);
  try {
    const token = fs.readFileSync(file, 'utf8').split('\n')[0].trim();
    return token || undefined;
  } catch {
    return undefined;
  }
}
