// Wiring: settings, the protocol client, the provider, the status bar, the
// commands (toggle, stats, accept tracking, partial accept, dismiss).

import * as vscode from 'vscode';

import { CompleterClient, CompletionResult, StateChange } from './client';
import { readSettings, SECTION, Settings } from './config';
import { ACCEPTED_COMMAND, CompleterProvider, textSource, VISIBLE_CONTEXT } from './provider';
import { Stats } from './stats';
import { STATS_COMMAND, StatusBar } from './status';
import { resolveToken } from './token';

export const CLIENT_NAME = 'vscode/0.1.0';

/** What `activate` returns (the extension's exports; the tests drive it). */
export interface CompleterApi {
  client: CompleterClient;
  provider: CompleterProvider;
  stats: Stats;
  status: StatusBar;
  settings(): Settings;
}

let active: { dispose(): void } | undefined;

export function activate(context: vscode.ExtensionContext): CompleterApi {
  let settings = readSettings();
  const output = vscode.window.createOutputChannel('completer');
  const stats = new Stats();
  const client = new CompleterClient({
    url: settings.serverUrl,
    token: () => resolveToken(settings.token, settings.tokenFile),
    clientName: CLIENT_NAME,
    maxBackoffMs: settings.reconnectMaxDelayMs,
  });
  const status = new StatusBar();
  let connection: StateChange = { state: 'stopped', detail: '', failures: 0 };
  let lastError: { code: string; message: string } | undefined;
  let warnedAuth = false;

  const refresh = () => status.update({
    enabled: settings.enabled,
    url: settings.serverUrl,
    connection,
    lastLatencyMs: stats.lastLatencyMs,
    error: lastError,
    model: client.server?.model.target,
  });

  client.on('state', (change: StateChange) => {
    connection = change;
    if (change.state === 'connected') {
      warnedAuth = false;
      output.appendLine(`connected to ${settings.serverUrl}`);
    } else if (change.httpStatus === 401 && !warnedAuth) {
      // Once, not per attempt: the token needs the user; everything else stays in the status bar.
      warnedAuth = true;
      void vscode.window.showWarningMessage(
        'completer: the server refused the token. Set "completer.token" or "completer.tokenFile" '
        + '(default: the token file `completer serve` prints).');
    }
    refresh();
  });
  client.on('result', (r: CompletionResult) => {
    stats.result(r);
    if (r.reason === 'error') {
      lastError = r.error;
      output.appendLine(`request ${r.id}: ${r.error?.code}: ${r.error?.message}`);
    } else if (r.reason !== 'cancelled' && r.reason !== 'disconnected') {
      lastError = undefined;
    }
    refresh();
  });
  client.on('log', (line: string) => output.appendLine(line));
  client.on('ready', () => refresh());

  const provider = new CompleterProvider(client, stats, () => settings, (shown, how) => {
    client.feedback(shown.id, shown.accepted);
    stats.finished(shown, how);
    void vscode.commands.executeCommand('setContext', VISIBLE_CONTEXT, false);
  });

  const apply = () => {
    const old = settings;
    settings = readSettings();
    provider.debounce.setRange({ minMs: settings.debounceMinMs, maxMs: settings.debounceMaxMs });
    if (old.serverUrl !== settings.serverUrl || old.token !== settings.token || old.tokenFile !== settings.tokenFile
      || old.reconnectMaxDelayMs !== settings.reconnectMaxDelayMs) {
      client.reconfigure({ url: settings.serverUrl, maxBackoffMs: settings.reconnectMaxDelayMs });
    }
    if (settings.enabled) {
      client.start();
    } else {
      provider.tracker.finish('dismissed');
      client.stop();
    }
    refresh();
  };

  /** Our partial accepts run VS Code's own, and credit what it inserted to the suggestion. */
  const acceptPartly = async (builtin: string) => {
    const before = vscode.window.activeTextEditor;
    if (before && provider.tracker.current) {
      provider.tracker.observe(textSource(before.document), before.document.offsetAt(before.selection.active), 'typed');
    }
    provider.accepting = true;
    try {
      await vscode.commands.executeCommand(builtin);
    } finally {
      provider.accepting = false;
    }
    const editor = vscode.window.activeTextEditor;
    if (editor && provider.tracker.current) {
      provider.tracker.observe(textSource(editor.document), editor.document.offsetAt(editor.selection.active), 'accepted');
      if (provider.tracker.current) {
        provider.tracker.current.version = editor.document.version;
      }
    }
  };

  const showStats = () => {
    const lines = [
      `completer (${settings.serverUrl}): ${connection.state}${connection.detail ? ` (${connection.detail})` : ''}`
        + `${client.server ? `, ${client.server.server}, model ${client.server.model.target}` : ''}`,
      ...stats.lines(),
      `debounce: ${provider.debounce.delayMs()} ms (typing gap ${fmt(provider.debounce.typingGapMs)}, `
        + `latency ${fmt(provider.debounce.latencyMs)}; range ${settings.debounceMinMs}-${settings.debounceMaxMs} ms)`,
    ];
    output.appendLine(`--- stats ${new Date().toISOString()}`);
    lines.forEach((l) => output.appendLine(l));
    output.show(true);
    const rate = stats.shownChars ? ` ${((100 * stats.acceptedChars) / stats.shownChars).toFixed(0)}% of shown chars accepted,` : '';
    void vscode.window.showInformationMessage(
      `completer: ${connection.state}, ${stats.requests} requests,${rate} last latency ${fmt(stats.lastLatencyMs)} (details in the "completer" output)`);
    return lines;
  };

  context.subscriptions.push(
    vscode.languages.registerInlineCompletionItemProvider(
      [{ scheme: 'file' }, { scheme: 'untitled' }, { scheme: 'vscode-remote' }], provider),
    vscode.commands.registerCommand(ACCEPTED_COMMAND, (id: string) => {
      const editor = vscode.window.activeTextEditor;
      provider.tracker.acceptedWhole(String(id), editor ? textSource(editor.document) : undefined,
        editor ? editor.document.offsetAt(editor.selection.active) : undefined);
    }),
    vscode.commands.registerCommand('completer.acceptNextWord', () => acceptPartly('editor.action.inlineSuggest.acceptNextWord')),
    vscode.commands.registerCommand('completer.acceptNextLine', () => acceptPartly('editor.action.inlineSuggest.acceptNextLine')),
    vscode.commands.registerCommand('completer.dismiss', async () => {
      provider.tracker.finish('dismissed');
      await vscode.commands.executeCommand('editor.action.inlineSuggest.hide');
    }),
    vscode.commands.registerCommand('completer.toggle', async () => {
      await vscode.workspace.getConfiguration(SECTION).update('enabled', !settings.enabled, vscode.ConfigurationTarget.Global);
      apply();
    }),
    vscode.commands.registerCommand(STATS_COMMAND, showStats),
    vscode.workspace.onDidChangeConfiguration((e) => {
      if (e.affectsConfiguration(SECTION)) {
        apply();
      }
    }),
    vscode.window.onDidChangeTextEditorSelection((e) => {
      const doc = e.textEditor.document;
      provider.noteCursor(doc, e.selections[0]?.active.line ?? 0);
      const shown = provider.tracker.current;
      // A cursor move (no edit since we last looked) off the suggestion dismisses it;
      // edits are judged by the provider and the accept commands.
      if (shown && !provider.accepting && shown.uri === doc.uri.toString() && shown.version === doc.version) {
        const sel = e.selections;
        if (sel.length !== 1 || !sel[0].isEmpty
          || provider.tracker.match(textSource(doc), doc.offsetAt(sel[0].active)) === undefined) {
          provider.tracker.finish('dismissed');
        }
      }
    }),
    vscode.window.onDidChangeActiveTextEditor((editor) => {
      if (editor) {
        provider.noteCursor(editor.document, editor.selection.active.line);
      }
      const shown = provider.tracker.current;
      if (shown && (!editor || editor.document.uri.toString() !== shown.uri)) {
        provider.tracker.finish('dismissed');
      }
    }),
    status,
    output,
    { dispose: () => client.dispose() },
  );
  active = { dispose: () => client.dispose() };
  if (settings.enabled) {
    client.start();
  }
  refresh();
  return { client, provider, stats, status, settings: () => settings };
}

export function deactivate(): void {
  active?.dispose();
  active = undefined;
}

function fmt(ms: number | undefined): string {
  return ms === undefined ? '-' : `${Math.round(ms)} ms`;
}
