// The token in VS Code's secret storage (the OS keychain), not in settings:
// Settings Sync copies settings to other machines and into the cloud. A token
// found in the old `completer.token` setting is moved there, and the setting
// cleared. Without a stored token the token file is read (token.ts).

import * as vscode from 'vscode';

import { SECTION } from './config';

export const SECRET_KEY = 'completer.token';
export const SET_TOKEN_COMMAND = 'completer.setToken';

export class TokenStore implements vscode.Disposable {
  private stored: string | undefined;
  private subscription: vscode.Disposable | undefined;

  constructor(private readonly secrets: vscode.SecretStorage) {}

  /** Call `changed` whenever the stored token changes (here or in another window). */
  watch(changed: () => void): void {
    this.subscription?.dispose();
    this.subscription = this.secrets.onDidChange((e) => {
      if (e.key === SECRET_KEY) {
        void this.load().then(changed);
      }
    });
  }

  /** The stored token; undefined: use the token file. Read synchronously on every connection attempt. */
  get token(): string | undefined {
    return this.stored;
  }

  async load(): Promise<void> {
    const value = (await this.secrets.get(SECRET_KEY))?.trim();
    this.stored = value || undefined;
  }

  /** Store `token`; empty or undefined: forget it (the token file is read again). */
  async set(token: string | undefined): Promise<void> {
    const value = token?.trim();
    if (value) {
      await this.secrets.store(SECRET_KEY, value);
    } else {
      await this.secrets.delete(SECRET_KEY);
    }
    this.stored = value || undefined;
  }

  /**
   * Move a token from the `completer.token` setting into the secret storage
   * and clear the setting wherever it is set. True when one was moved.
   */
  async migrate(): Promise<boolean> {
    const config = vscode.workspace.getConfiguration(SECTION);
    const where = config.inspect<string>('token');
    const targets: [string | undefined, vscode.ConfigurationTarget][] = [
      [where?.workspaceFolderValue, vscode.ConfigurationTarget.WorkspaceFolder],
      [where?.workspaceValue, vscode.ConfigurationTarget.Workspace],
      [where?.globalValue, vscode.ConfigurationTarget.Global],
    ];
    const value = targets.map(([v]) => v?.trim()).find((v) => v);
    if (!value) {
      return false;
    }
    await this.set(value);
    for (const [v, target] of targets) {
      if (v !== undefined) {
        await config.update('token', undefined, target);
      }
    }
    return true;
  }

  /** The command: ask for the token (hidden as it is typed) and store it; an empty answer forgets it. */
  async prompt(): Promise<boolean> {
    const answer = await vscode.window.showInputBox({
      title: 'completer: token',
      prompt: 'The token `completer serve` prints (kept in VS Code\'s secret storage). Leave empty to read the token file instead.',
      password: true,
      ignoreFocusOut: true,
    });
    if (answer === undefined) {
      return false; // cancelled
    }
    await this.set(answer);
    return true;
  }

  dispose(): void {
    this.subscription?.dispose();
  }
}
