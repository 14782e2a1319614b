// A connection that dies without a close (sleep and resume, a dropped tunnel,
// a frozen server): played by the real server stopped with SIGSTOP, its
// socket still open and the kernel still acknowledging what is sent, while
// nothing answers. Requests must end by their deadline, and the connection
// must be found dead and made again.

import './vscode-hook';

import assert from 'node:assert/strict';
import { after, afterEach, before, describe, it } from 'node:test';

import { CompleterClient, StateChange } from '../src/client';
import { fake, InlineCompletionTriggerKind } from './fake-vscode';
import { Server, waitFor } from './server';
import { closeSession, completes, start } from './session';

const TOKEN = 'vscode-liveness-test-token';
let server: Server;
const cleanup: (() => unknown)[] = [];

/** Freeze the server; it is thawed after the test whatever happens. */
function freeze(): void {
  server.proc.kill('SIGSTOP');
  cleanup.push(() => server.proc.kill('SIGCONT'));
}

before(async () => {
  server = await Server.start(TOKEN);
});

after(async () => {
  server.proc.kill('SIGCONT');
  await server?.stop();
});

afterEach(async () => {
  closeSession();
  for (const fn of cleanup.splice(0).reverse()) {
    await fn();
  }
});

describe('a connection that went silent', () => {
  it('a request ends at its deadline plus a margin, the connection is found dead and made again', async () => {
    const s = await start(server, { 'completer.token': TOKEN, 'completer.deadlineMs': 1000, 'completer.reconnect.maxDelayMs': 500 });
    const states: StateChange[] = [];
    s.api.client.on('state', (c: StateChange) => states.push(c));
    fake.open('file:///proj/app/frozen.py', 'python', 'def area(width, height):\n    return |\n');

    freeze();
    const sentAt = Date.now();
    const items = fake.trigger(InlineCompletionTriggerKind.Invoke);
    const request = completes(s).at(-1);
    assert.equal(request?.deadline_ms, 1000);
    // The client's margin is 2 s: the request is given up by about 3 s, not left waiting.
    const ended = await waitFor(() => s.results.find((r) => r.id === request?.id), 'the request to be given up', 6000);
    assert.equal(ended.reason, 'timeout');
    assert.equal(await items, undefined, 'nothing is shown');
    const waited = Date.now() - sentAt;
    assert.ok(waited >= 2900 && waited < 5000, `given up after ${waited} ms`);
    assert.ok(s.sent.some((m) => m.type === 'cancel' && m.id === request?.id), 'the server is told, should it wake');

    // The overrun made the client ping; no pong within 5 s: the connection is dead.
    await waitFor(() => states.some((c) => c.state === 'disconnected'), 'the connection to be found dead', 8000);
    assert.match(states.find((c) => c.state === 'disconnected')?.detail ?? '', /no answer from the server/);
    assert.match(fake.state.statusItems[0].text, /offline/);

    server.proc.kill('SIGCONT');
    await waitFor(() => s.api.client.connected, 'the connection to be made again', 20_000);
    await fake.trigger(InlineCompletionTriggerKind.Invoke);
    const last = s.results.at(-1);
    assert.ok(last && ['stop', 'length', 'eos', 'deadline'].includes(last.reason), `after the thaw: ${last?.reason}`);
  });

  it('an idle connection is checked after the silence, and found dead when the ping goes unanswered', async () => {
    // A pong may take a while from a server on a busy machine: 1.5 s before it counts as missing.
    const client = new CompleterClient({ url: server.url, token: () => TOKEN, silenceMs: 300, pongTimeoutMs: 1500 });
    cleanup.push(() => client.dispose());
    const states: StateChange[] = [];
    client.on('state', (c: StateChange) => states.push(c));
    client.start();
    await waitFor(() => client.connected, 'the connection');
    // A live server answers each ping: silence alone is no reason to drop it.
    await new Promise((r) => setTimeout(r, 2000));
    assert.deepEqual(states.map((c) => c.state), ['connecting', 'connected']);

    freeze();
    const frozenAt = Date.now();
    await waitFor(() => client.state !== 'connected', 'the connection to be found dead', 5000);
    const elapsed = Date.now() - frozenAt;
    assert.ok(elapsed < 4000, `found dead after ${elapsed} ms (silence 300 ms, then a ping unanswered for 1.5 s)`);
    assert.match(states.find((c) => c.state === 'disconnected')?.detail ?? '', /no answer from the server/);
  });
});
