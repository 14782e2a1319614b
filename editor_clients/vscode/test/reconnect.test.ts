// The server down, killed and restarted: a quiet status, no popups, no
// requests, and a reconnection with backoff.

import './vscode-hook';

import assert from 'node:assert/strict';
import { afterEach, describe, it } from 'node:test';

import type { CompletionResult, StateChange } from '../src/client';
import type * as vscode from 'vscode';

import { activate, CompleterApi, deactivate } from '../src/extension';
import { fake, InlineCompletionTriggerKind } from './fake-vscode';
import { freePort, Msg, Server, waitFor } from './server';


const TOKEN = 'vscode-reconnect-test-token';
const cleanup: (() => unknown)[] = [];

afterEach(async () => {
  for (const fn of cleanup.splice(0).reverse()) {
    await fn();
  }
});

async function start(url: string, config: Record<string, unknown> = {}) {
  fake.reset({ 'completer.serverUrl': url, 'completer.token': TOKEN, 'completer.reconnect.maxDelayMs': 1000, ...config });
  const context = fake.context();
  const api: CompleterApi = await activate(context as unknown as vscode.ExtensionContext);
  const sent: Msg[] = [];
  const states: (StateChange & { at: number })[] = [];
  const results: CompletionResult[] = [];
  api.client.on('sent', (m: Msg) => sent.push(m));
  api.client.on('state', (c: StateChange) => states.push({ ...c, at: Date.now() }));
  api.client.on('result', (r: CompletionResult) => {
    if (r.purpose === 'complete') { // not the priming of a document as it opens
      results.push(r);
    }
  });
  cleanup.push(() => {
    context.subscriptions.forEach((d) => d.dispose());
    deactivate();
  });
  return { api, sent, states, results };
}

/** The requests for a suggestion (not those priming a document's prompt). */
const completes = (sent: Msg[]) => sent.filter((m) => m.type === 'complete' && m.max_tokens !== 0);

const noPopups = () => {
  assert.deepEqual(fake.state.messages, { error: [], warning: [], info: [] }, 'no message boxes');
};

describe('server down', () => {
  it('keystrokes send nothing and show no error; the status bar says offline', async () => {
    const port = await freePort();
    const { api, sent } = await start(`ws://127.0.0.1:${port}/v1/ws`);
    await waitFor(() => api.client.state === 'disconnected', 'a failed attempt');
    fake.open('file:///proj/app/down.py', 'python', 'def f(x):\n    return |\n');
    const started = Date.now();
    for (let i = 0; i < 40; i++) {
      assert.deepEqual(await Promise.all(fake.type('a')), [undefined]);
    }
    assert.ok(Date.now() - started < 2000, 'offline keystrokes return at once (no debounce, no waiting)');
    assert.equal(await fake.trigger(InlineCompletionTriggerKind.Invoke), undefined);
    assert.equal(api.stats.skippedOffline, 41);
    assert.equal(completes(sent).length, 0);
    noPopups();
    const status = fake.state.statusItems[0];
    assert.match(status.text, /offline/);
    assert.match(status.tooltip ?? '', /refused/);
    assert.match(status.tooltip ?? '', new RegExp(`127\\.0\\.0\\.1:${port}`));
  });

  it('reconnects with backoff after the server is killed and started again on its port', async () => {
    const first = await Server.start(TOKEN);
    cleanup.push(() => first.stop('SIGKILL'));
    const { api, sent, states, results } = await start(first.url, { 'completer.maxTokens': 200 });
    await waitFor(() => api.client.connected, 'the first connection');
    const editor = fake.open('file:///proj/app/restart.py', 'python', 'class Stack:\n    def push(self, item):\n|\n');

    // Kill the server with a request in flight: it ends as `disconnected`, nothing is shown.
    const inflight = fake.trigger(InlineCompletionTriggerKind.Invoke);
    assert.equal(completes(sent).length, 1);
    await first.stop('SIGKILL');
    assert.equal(await inflight, undefined);
    assert.equal(results.at(-1)?.reason, 'disconnected');
    await waitFor(() => api.client.state === 'disconnected', 'the disconnection');
    const downAt = Date.now();

    // While it is down: attempts back off (250 ms doubling, jittered, capped at 1 s); keystrokes stay quiet.
    for (let i = 0; i < 10; i++) {
      await Promise.all(fake.type('x'));
    }
    await waitFor(() => states.filter((s) => s.at >= downAt - 50 && s.state === 'disconnected').length >= 4,
      'several failed attempts', 10_000);
    const waits = states.filter((s) => s.state === 'disconnected' && s.at >= downAt - 50).map((s) => s.retryInMs as number);
    assert.ok(waits[0] < waits[1] && waits[1] < waits[2], `backoff grows: ${waits.join(', ')}`);
    assert.ok(waits.every((w) => w > 0 && w <= 1000), `backoff capped: ${waits.join(', ')}`);
    noPopups();
    assert.match(fake.state.statusItems[0].text, /offline/);
    assert.equal(completes(sent).length, 1, 'nothing sent while down');

    const second = await Server.start(TOKEN, first.port);
    cleanup.push(() => second.stop());
    await waitFor(() => api.client.connected, 'the reconnection', 30_000);
    assert.equal(sent.filter((m) => m.type === 'hello').length, 2, 'a hello on each connection');
    noPopups();

    editor.selections = [editor.selections[0]];
    const items = await fake.trigger(InlineCompletionTriggerKind.Invoke);
    const last = results.at(-1) as CompletionResult;
    assert.ok(['stop', 'length', 'eos', 'deadline'].includes(last.reason), `ended: ${last.reason}`);
    assert.equal(last.deltas.join(''), last.text);
    assert.equal(items?.[0]?.insertText ?? '', last.text.trim() ? last.text : '');
    assert.doesNotMatch(fake.state.statusItems[0].text, /offline/);
  });
});
