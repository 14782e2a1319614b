// Wiring: settings, the token, the protocol client, the provider and what it
// draws on (cache, context, prefetching, privacy), the status bar, the
// commands, and the editor events that feed them (editors.ts).

import * as vscode from 'vscode';

import { CompletionCache } from './cache';
import { CompleterClient, CompletionResult, StateChange } from './client';
import { readSettings, SECTION, Settings } from './config';
import { ContextCollector } from './context';
import { Definitions } from './definitions';
import { watchEditors } from './editors';
import { FeedbackLedger } from './feedback';
import { Prefetcher } from './prefetch';
import { PrivacyFilter } from './privacy';
import { CompleterProvider, PROVIDED_SCHEMES, VISIBLE_CONTEXT } from './provider';
import { SET_TOKEN_COMMAND, TokenStore } from './secrets';
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
  cache: CompletionCache;
  context: ContextCollector;
  definitions: Definitions;
  tokens: TokenStore;
  settings(): Settings;
}

let active: { dispose(): void } | undefined;

export async function activate(context: vscode.ExtensionContext): Promise<CompleterApi> {
  let settings = readSettings();
  const output = vscode.window.createOutputChannel('completer');
  const stats = new Stats();
  const tokens = new TokenStore(context.secrets);
  await tokens.load();
  if (await tokens.migrate()) {
    output.appendLine('moved the token from the "completer.token" setting into VS Code\'s secret storage');
    settings = readSettings();
  }
  let usedToken: string | undefined;
  const currentToken = () => resolveToken(tokens.token ?? '', settings.tokenFile);
  const client = new CompleterClient({
    url: settings.serverUrl,
    token: () => (usedToken = currentToken()),
    clientName: CLIENT_NAME,
    maxBackoffMs: settings.reconnectMaxDelayMs,
    requestTimeoutMs: settings.requestTimeoutMs,
  });
  /** A new token (set here, in another window, or a new token file setting): connect with it now. */
  const tokenChanged = () => {
    if (client.state !== 'stopped' && currentToken() !== usedToken) {
      client.reconfigure({});
    }
  };
  tokens.watch(tokenChanged);

  const privacy = new PrivacyFilter(settings);
  const feedback = new FeedbackLedger((id, report) => client.feedback(id, report));
  const cache = new CompletionCache(settings.cacheSize, (entry) => feedback.dropped(entry.id));
  const collector = new ContextCollector(
    () => ({ enabled: settings.contextEnabled, maxSnippets: settings.contextMaxSnippets, maxChars: settings.contextMaxChars }),
    (uri) => !privacy.excludedPath(uri));
  const definitions = new Definitions({
    lookup: async (uri, line, character) => {
      const found = await vscode.commands.executeCommand<(vscode.Location | vscode.LocationLink)[] | undefined>(
        'vscode.executeDefinitionProvider', vscode.Uri.parse(uri), new vscode.Position(line, character));
      return (found ?? []).map((l) => 'targetUri' in l
        ? { uri: l.targetUri.toString(), line: l.targetRange.start.line }
        : { uri: l.uri.toString(), line: l.range.start.line });
    },
    read: async (uri, line, lines) => {
      const doc = await vscode.workspace.openTextDocument(vscode.Uri.parse(uri));
      const end = Math.min(doc.lineCount, line + lines);
      const text = Array.from({ length: Math.max(0, end - line) }, (_, i) => doc.lineAt(line + i).text).join('\n');
      return { text, languageId: doc.languageId };
    },
  }, () => ({ max: settings.contextEnabled ? settings.contextDefinitions : 0, maxChars: settings.contextMaxChars }),
  (uri) => !privacy.excludedPath(uri));
  const workspaceOf = (uri: string) => vscode.workspace.getWorkspaceFolder(vscode.Uri.parse(uri))?.uri.toString();
  const prefetch = new Prefetcher(client, cache, (doc, cursor) => provider.params(doc, cursor));
  const provider: CompleterProvider = new CompleterProvider({
    client, stats, settings: () => settings, privacy, cache, context: collector, definitions, workspaceOf, prefetch, feedback,
    onFinish: (shown, how) => {
      feedback.finished(shown);
      stats.finished(shown, how);
      void vscode.commands.executeCommand('setContext', VISIBLE_CONTEXT, false);
    },
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
    generating: client.generating > 0,
  });

  const editors = watchEditors({ provider, prefetch, context: collector, definitions, settings: () => settings });
  client.on('state', (change: StateChange) => {
    connection = change;
    if (change.state === 'connected') {
      warnedAuth = false;
      output.appendLine(`connected to ${settings.serverUrl}`);
      editors.primeActive(); // a new connection may be a restarted server, its cache cold
    } else if (change.httpStatus === 401 && !warnedAuth) {
      // Once, not per attempt: the token needs the user; everything else stays in the status bar.
      warnedAuth = true;
      void vscode.window.showWarningMessage(
        'completer: the server refused the token. Run "Completer: Set Token", or set "completer.tokenFile" '
        + '(default: the token file `completer serve` prints).');
    }
    refresh();
  });
  client.on('result', (r: CompletionResult) => {
    stats.result(r);
    if (r.purpose === 'prime') {
      if (r.reason === 'error') { // an older server refuses max_tokens 0: not the user's concern
        output.appendLine(`priming ${r.id}: ${r.error?.code}: ${r.error?.message}`);
      }
      return;
    }
    if ((r.reason === 'error' || r.reason === 'timeout') && r.error) {
      lastError = r.error;
      output.appendLine(`request ${r.id}: ${r.error.code}: ${r.error.message}`);
    } else if (r.reason !== 'cancelled' && r.reason !== 'disconnected') {
      lastError = undefined;
    }
    refresh();
  });
  client.on('log', (line: string) => output.appendLine(line));
  client.on('ready', () => refresh());
  client.on('generating', () => refresh()); // the spinner: on while a suggestion is generated, off when it ends

  const apply = async () => {
    const old = settings;
    settings = readSettings();
    if (settings.token.trim() && await tokens.migrate()) { // someone set the old setting again
      output.appendLine('moved the token from the "completer.token" setting into VS Code\'s secret storage');
      settings = readSettings();
    }
    privacy.update(settings);
    cache.setCapacity(settings.cacheSize);
    provider.debounce.setRange({ minMs: settings.debounceMinMs, maxMs: settings.debounceMaxMs });
    if (old.serverUrl !== settings.serverUrl || old.reconnectMaxDelayMs !== settings.reconnectMaxDelayMs) {
      client.reconfigure({ url: settings.serverUrl, maxBackoffMs: settings.reconnectMaxDelayMs,
        requestTimeoutMs: settings.requestTimeoutMs });
    } else if (old.requestTimeoutMs !== settings.requestTimeoutMs) {
      client.setRequestTimeout(settings.requestTimeoutMs); // no reconnect: requests sent from now on
    }
    if (settings.enabled) {
      client.start();
      tokenChanged();
    } else {
      provider.tracker.finish('dismissed');
      client.stop();
    }
    if (!settings.enabled || !settings.requestOnKeystroke) {
      provider.early.drop();
    }
    refresh();
  };

  const showStats = () => {
    const lines = [
      `completer (${settings.serverUrl}): ${connection.state}${connection.detail ? ` (${connection.detail})` : ''}`
        + `${client.server ? `, ${client.server.server}, model ${client.server.model.target}` : ''}`,
      ...stats.lines(),
      `debounce: ${provider.debounce.delayMs(Date.now())} ms (the server's hold ${fmt(provider.debounce.holdMs)}; `
        + `range ${settings.debounceMinMs}-${settings.debounceMaxMs} ms)`,
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
      PROVIDED_SCHEMES.map((scheme) => ({ scheme })), provider),
    ...editors.subscriptions,
    vscode.commands.registerCommand('completer.toggle', async () => {
      await vscode.workspace.getConfiguration(SECTION).update('enabled', !settings.enabled, vscode.ConfigurationTarget.Global);
      await apply();
    }),
    vscode.commands.registerCommand(SET_TOKEN_COMMAND, async () => {
      if (await tokens.prompt()) {
        tokenChanged();
      }
    }),
    vscode.commands.registerCommand(STATS_COMMAND, showStats),
    vscode.workspace.onDidChangeConfiguration((e) => {
      if (e.affectsConfiguration(SECTION)) {
        void apply();
      }
    }),
    status,
    output,
    tokens,
    { dispose: () => client.dispose() },
  );
  active = { dispose: () => client.dispose() };
  if (settings.enabled) {
    client.start();
  }
  refresh();
  return { client, provider, stats, status, cache, context: collector, definitions, tokens, settings: () => settings };
}

export function deactivate(): void {
  active?.dispose();
  active = undefined;
}

function fmt(ms: number | undefined): string {
  return ms === undefined ? '-' : `${Math.round(ms)} ms`;
}
