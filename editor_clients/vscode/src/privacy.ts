// Which documents the extension may read: nothing of an excluded document is
// sent, neither to complete it nor as context for another. No vscode API.

/**
 * Files that usually hold secrets (keys, tokens, passwords), excluded unless
 * `completer.excludeSensitiveFiles` is off. Matched case-insensitively
 * against the document's path; a pattern without `/` against its name alone.
 */
export const SENSITIVE_GLOBS: readonly string[] = [
  // The same list, in the same order, as the Neovim plugin's (lua/completer/config.lua's
  // SECRETS); tests/clients/test_secret_patterns.py holds the two to it.
  '.env', '.env.*', '*.env', '.envrc',
  '*.pem', '*.key', '*.p12', '*.pfx', '*.jks', '*.keystore', '*.gpg', '*.asc', '*.kdbx',
  'id_rsa*', 'id_dsa*', 'id_ecdsa*', 'id_ed25519*', '*.ppk',
  '.netrc', '_netrc', '.pgpass', '.npmrc', '.pypirc', '.git-credentials', '.htpasswd',
  'credentials', 'credentials.*', '*credentials*.json', 'secrets', 'secrets.*', '*.secret', '*.secrets',
  '*secret*.json', '*secret*.y*ml', 'client_secret*',
  '*.tfvars', '*.tfstate', '*.tfstate.*',
  '**/.ssh/**', '**/.aws/**', '**/.gnupg/**', '**/.docker/config.json', '**/.kube/config',
];

export interface PrivacySettings {
  /** languageId -> on/off; `*` for the rest. */
  languages: Record<string, boolean>;
  /** The user's own globs, excluded too. */
  exclude: string[];
  excludeSensitiveFiles: boolean;
}

/** The path part of a URI (`file:///home/a/.env` -> `/home/a/.env`), decoded. */
export function uriPath(uri: string): string {
  const m = /^[a-z][a-z0-9+.-]*:(\/\/[^/?#]*)?([^?#]*)/i.exec(uri);
  const path = m ? m[2] : uri;
  try {
    return decodeURIComponent(path);
  } catch {
    return path;
  }
}

/**
 * A glob as a regular expression: `**` any number of folders, `*` and `?`
 * within one name, `{a,b}` alternatives, `[...]` a class.
 */
export function globToRegExp(glob: string): RegExp {
  let re = '';
  let depth = 0; // inside {...}
  for (let i = 0; i < glob.length; i++) {
    const c = glob[i];
    if (c === '*' && glob[i + 1] === '*') {
      const slashAfter = glob[i + 2] === '/';
      re += slashAfter ? '(?:.*/)?' : '.*';
      i += slashAfter ? 2 : 1;
    } else if (c === '*') {
      re += '[^/]*';
    } else if (c === '?') {
      re += '[^/]';
    } else if (c === '{') {
      depth += 1;
      re += '(?:';
    } else if (c === '}' && depth > 0) {
      depth -= 1;
      re += ')';
    } else if (c === ',' && depth > 0) {
      re += '|';
    } else if (c === '[') {
      const close = glob.indexOf(']', i + 1);
      if (close < 0) {
        re += '\\[';
      } else {
        const body = glob.slice(i + 1, close).replace(/^!/, '^').replace(/\\/g, '\\\\');
        re += `[${body}]`;
        i = close;
      }
    } else {
      re += c.replace(/[.+^$()|\\/]/g, '\\$&');
    }
  }
  return new RegExp(`^${re}$`, 'i');
}

export class PrivacyFilter {
  private patterns: { re: RegExp; nameOnly: boolean }[] = [];

  constructor(private settings: PrivacySettings) {
    this.update(settings);
  }

  update(settings: PrivacySettings): void {
    this.settings = settings;
    const globs = [...(settings.excludeSensitiveFiles ? SENSITIVE_GLOBS : []), ...settings.exclude];
    this.patterns = globs.filter((g) => g.trim()).map((g) => ({ re: globToRegExp(g.trim()), nameOnly: !g.includes('/') }));
  }

  /** Whether completions are on for this language. */
  languageEnabled(languageId: string): boolean {
    const on = this.settings.languages;
    const v = Object.prototype.hasOwnProperty.call(on, languageId) ? on[languageId] : on['*'];
    return v !== false;
  }

  /** Whether the document at `uri` matches an exclusion glob (never read, never sent). */
  excludedPath(uri: string): boolean {
    const path = uriPath(uri);
    const name = path.slice(path.lastIndexOf('/') + 1);
    return this.patterns.some((p) => p.re.test(p.nameOnly ? name : path));
  }

  /** Whether this document may be completed. */
  allows(uri: string, languageId: string): boolean {
    return this.languageEnabled(languageId) && !this.excludedPath(uri);
  }
}
