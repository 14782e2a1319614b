// The extension against the real server (default models, ephemeral port),
// with only the `vscode` module replaced. The models are small: every check
// compares what the editor got with what the server sent, never expected code.

import './vscode-hook';

import assert from 'node:assert/strict';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { after, afterEach, before, describe, it } from 'node:test';

import { CancellationTokenSource, fake, InlineCompletionItem, InlineCompletionTriggerKind, nextWord } from './fake-vscode';
import { Msg, Server, waitFor } from './server';
import {
  chars, closeSession, completes, counters as serverCounters, countersMatch as serverCountersMatch, feedbackFor,
  insertedAt, PROMPTS, Session, start as startOn, suggestion, wire,
} from './session';
import { keptChars } from '../src/tracker';


const TOKEN = 'vscode-extension-test-token';
let server: Server;
let configHome: string;

const start = (config: Record<string, unknown> = {}, connect = true) => startOn(server, config, connect);
const counters = () => serverCounters(server);
const countersMatch = (s: Session, before: { shown: number; accepted: number }) => serverCountersMatch(server, s, before);

before(async () => {
  configHome = fs.mkdtempSync(path.join(os.tmpdir(), 'completer-vscode-'));
  fs.mkdirSync(path.join(configHome, 'completer'));
  fs.writeFileSync(path.join(configHome, 'completer', 'token'), `${TOKEN}\n`, { mode: 0o600 });
  process.env.XDG_CONFIG_HOME = configHome;
  server = await Server.start(TOKEN);
});

after(async () => {
  await server?.stop();
  fs.rmSync(configHome, { recursive: true, force: true });
});

afterEach(() => closeSession());

describe('completions from the real server', () => {
  it('streams: the suggestion is done.text, the deltas concatenated; prefix, suffix, mode and context are sent', async () => {
    const s = await start({ 'completer.context.maxChars': 200 });
    assert.equal(s.sent[0]?.type, 'hello');
    const other = Array.from({ length: 300 }, (_, i) => `VALUE_${i} = ${i}`).join('\n');
    // The user was at line 150 of another file, then went on to the one completed.
    const neighbour = fake.open('file:///proj/app/constants.py', 'python', other);
    const at = other.indexOf('VALUE_150 ');
    fake.select(neighbour, [at, at]);

    const shown = await suggestion(s, (t) => t.length > 0, 'stream');
    const request = completes(s).find((m) => m.id === shown.id) as Msg;
    assert.equal(request.document?.prefix, shown.before.slice(0, shown.cursor));
    assert.equal(request.document?.suffix, shown.before.slice(shown.cursor));
    assert.equal(request.document?.language, 'python');
    assert.equal(request.document?.uri, shown.editor.document.uri.toString());
    const line = shown.before.slice(0, shown.cursor).split('\n').at(-1) as string;
    assert.equal(request.mode, line.trim() === '' ? 'block' : 'line');
    const context = request.context as { uri: string; text: string }[];
    const snippet = context.find((c) => c.uri === 'file:///proj/app/constants.py');
    assert.ok(snippet, `the other editor's text is sent as context: ${JSON.stringify(context)}`);
    assert.ok(snippet.text.length <= 200 && snippet.text.includes('VALUE_150 = 150'), snippet.text);
    assert.ok(context.length <= 4);

    // A mid-line cursor asks for the rest of the line.
    fake.open('file:///proj/app/mid.py', 'python', 'def f(a, b):\n    return a |\n');
    await fake.trigger();
    assert.equal(completes(s).at(-1)?.mode, 'line');
    const ok = s.results.filter((r) => r.reason !== 'cancelled');
    assert.ok(ok.length >= 2 && ok.every((r) => r.deltas.join('') === r.text));
    assert.match(fake.state.statusItems[0].text, /completer \d+ ms/);
  });

  it('cancel on keystroke: the token sends `cancel` and the server ends the request as cancelled', async () => {
    const s = await start({ 'completer.maxTokens': 200, 'completer.debounce.minMs': 150, 'completer.debounce.maxMs': 150 });
    fake.open('file:///proj/app/cancel.py', 'python', PROMPTS[0]);
    const first = fake.trigger(InlineCompletionTriggerKind.Invoke);
    const request = completes(s).at(-1) as Msg;
    assert.ok(request, 'sent at once (an explicit trigger is not debounced)');
    assert.equal(request.min_first_prob, 0, 'asked for: shown even where the model is unsure of its first token');
    const typed = fake.type('    x'); // five keystrokes: each cancels the call before it
    assert.equal(await first, undefined, 'a cancelled call shows nothing');
    assert.ok(s.sent.some((m) => m.type === 'cancel' && m.id === request.id), 'cancel sent');
    const { done } = await wire(s, request.id as string);
    assert.equal(done.type, 'done');
    assert.equal(done.reason, 'cancelled');
    const results = await Promise.all(typed);
    assert.deepEqual(results.slice(0, -1), [undefined, undefined, undefined, undefined]);
    assert.equal(completes(s).length, 2, 'keystrokes inside the debounce sent nothing; the last one sent one request');
    const last = completes(s)[1];
    assert.equal(last.document?.prefix.endsWith('    x'), true);
    assert.equal(last.min_first_prob, undefined, 'typing: the server\'s confidence rules');
    const end = await wire(s, last.id as string);
    assert.notEqual(end.done.reason, 'cancelled');
    assert.ok(!s.sent.some((m) => m.type === 'cancel' && m.id === last.id));
  });

  it('supersede: a newer request for the same document ends the older one, without a `cancel`', async () => {
    const s = await start({ 'completer.maxTokens': 200 });
    const editor = fake.open('file:///proj/app/supersede.py', 'python', PROMPTS[1]);
    const ctx = { triggerKind: InlineCompletionTriggerKind.Invoke, selectedCompletionInfo: undefined };
    const a = fake.provider.provideInlineCompletionItems(editor.document, editor.selection.active, ctx, new CancellationTokenSource().token);
    const b = fake.provider.provideInlineCompletionItems(editor.document, editor.selection.active, ctx, new CancellationTokenSource().token);
    const [first, second] = completes(s);
    assert.equal(await a, undefined);
    assert.equal((await wire(s, first.id as string)).done.reason, 'cancelled');
    assert.ok(!s.sent.some((m) => m.type === 'cancel'));
    const end = await wire(s, second.id as string);
    const items = await b;
    assert.equal(items?.[0]?.insertText ?? '', String(end.done.text).trim() ? end.done.text : '');
  });

  it('accept next word, next line, then the rest: feedback counts every accepted char', async () => {
    const s = await start();
    const before = await counters();
    const shown = await suggestion(s, (t) => nextWord(t).length < t.length, 'accept');
    const word = nextWord(shown.text);

    await fake.commandsRun('completer.acceptNextWord');
    assert.ok(fake.state.executed.some((e) => e.command === 'editor.action.inlineSuggest.acceptNextWord'));
    assert.equal(shown.editor.document.getText(), insertedAt(shown, word));
    const current = s.api.provider.tracker.current;
    assert.equal(current && keptChars(current).accepted, chars(word));
    assert.equal(feedbackFor(s, shown.id).length, 0, 'no feedback until the suggestion ends');
    if (fake.state.ghost) {
      await fake.commandsRun('completer.acceptNextLine');
    }
    if (fake.state.ghost) {
      await fake.commandsRun('editor.action.inlineSuggest.commit'); // Tab
    }
    assert.equal(shown.editor.document.getText(), insertedAt(shown, shown.text));
    assert.deepEqual(feedbackFor(s, shown.id),
      [{ type: 'feedback', id: shown.id, accepted_chars: chars(shown.text), typed_chars: 0, shown: true }]);
    assert.equal(s.api.provider.tracker.current, undefined);
    await countersMatch(s, before);
    assert.equal(s.api.stats.acceptedWhole, 1);

    // Next word, then Escape: the accepted word is reported.
    const again = await suggestion(s, (t) => nextWord(t).length < t.length, 'partial');
    await fake.commandsRun('completer.acceptNextWord');
    await fake.commandsRun('completer.dismiss');
    assert.ok(fake.state.executed.some((e) => e.command === 'editor.action.inlineSuggest.hide'));
    assert.equal(fake.state.ghost, undefined);
    assert.deepEqual(feedbackFor(s, again.id),
      [{ type: 'feedback', id: again.id, accepted_chars: chars(nextWord(again.text)), typed_chars: 0, shown: true }]);
    assert.equal(s.api.stats.acceptedPartly, 1);
    await countersMatch(s, before);
  });

  it('dismiss (Escape, or typing something else) sends feedback 0', async () => {
    const s = await start();
    const before = await counters();
    const one = await suggestion(s, (t) => t.length > 0, 'dismiss');
    assert.equal(fake.state.contextKeys['completer.suggestionVisible'], true);
    await fake.commandsRun('completer.dismiss');
    assert.deepEqual(feedbackFor(s, one.id), [{ type: 'feedback', id: one.id, accepted_chars: 0, typed_chars: 0, shown: true }]);
    assert.equal(fake.state.contextKeys['completer.suggestionVisible'], false);

    const two = await suggestion(s, (t) => t.length > 0, 'diverge');
    const other = two.text[0] === '§' ? '¤' : '§';
    await Promise.all(fake.type(other));
    assert.deepEqual(feedbackFor(s, two.id), [{ type: 'feedback', id: two.id, accepted_chars: 0, typed_chars: 0, shown: true }]);
    assert.ok(s.sent.filter((m) => m.type === 'feedback').every((m) => m.accepted_chars === 0));
    await countersMatch(s, before);
    assert.equal(s.api.stats.dismissed, 2);
  });

  it('type-through: typing what the suggestion says keeps showing the rest without a request', async () => {
    const s = await start();
    const shown = await suggestion(s, (t) => t.length >= 3, 'typethrough');
    const requests = completes(s).length;
    // No flicker: the rest comes back before any timer or I/O runs (no debounce, no round trip).
    const [typed] = fake.type(shown.text[0]);
    const a = await Promise.race([typed, new Promise<'late'>((r) => setImmediate(() => r('late')))]);
    assert.ok(a !== 'late', 'the rest is served at once');
    assert.deepEqual(a?.map((i: InlineCompletionItem) => [i.insertText, i.command?.arguments]), [[shown.text.slice(1), [shown.id, 0]]]);
    const [b] = await Promise.all(fake.type(shown.text[1]));
    assert.equal(b?.[0]?.insertText, shown.text.slice(2));
    assert.equal(completes(s).length, requests, 'no new request');
    assert.equal(s.api.stats.typeThrough, 2);
    await fake.commandsRun('editor.action.inlineSuggest.commit'); // Tab on the rest
    assert.equal(shown.editor.document.getText(), insertedAt(shown, shown.text));
    assert.deepEqual(feedbackFor(s, shown.id),
      [{ type: 'feedback', id: shown.id, accepted_chars: chars(shown.text.slice(2)), typed_chars: 2, shown: true }],
      'typed chars are reported apart from accepted ones');
  });

  it('no request while a selection or several cursors are active, or when turned off', async () => {
    const s = await start();
    const editor = fake.open('file:///proj/app/select.py', 'python', PROMPTS[3]);
    const at = editor.cursor;
    fake.select(editor, [at - 6, at]);
    assert.equal(await fake.trigger(), undefined);
    fake.select(editor, [at, at], [at - 10, at - 10]);
    assert.equal(await fake.trigger(), undefined);
    assert.equal(completes(s).length, 0);

    await fake.commandsRun('completer.toggle');
    assert.equal(s.api.client.state, 'stopped');
    assert.match(fake.state.statusItems[0].text, /off/);
    fake.select(editor, [at, at]);
    assert.equal(await fake.trigger(), undefined);
    assert.equal(completes(s).length, 0);
    await fake.commandsRun('completer.toggle');
    await waitFor(() => s.api.client.connected, 'reconnect after toggling on');
    await fake.trigger();
    assert.equal(completes(s).length, 1);

    const lines = await fake.commandsRun<string[]>('completer.showStats');
    assert.ok(lines.some((l) => l.startsWith('requests: 1')), lines.join('\n'));
    assert.equal(fake.state.messages.info.length, 1);
  });

  it('a wrong token: a quiet offline status and a single warning, however many keystrokes', async () => {
    const s = await start({ 'completer.token': 'not-the-token', 'completer.reconnect.maxDelayMs': 300 }, false);
    await waitFor(() => s.api.client.state === 'disconnected' && (fake.state.statusItems[0].tooltip ?? '').includes('401'), 'a 401');
    fake.open('file:///proj/app/token.py', 'python', PROMPTS[3]);
    for (let i = 0; i < 5; i++) {
      await Promise.all(fake.type('a'));
    }
    await waitFor(() => Number(/\((\d+) failed/.exec(fake.state.statusItems[0].tooltip ?? '')?.[1] ?? 0) >= 3, 'several attempts');
    assert.match(fake.state.statusItems[0].text, /offline/);
    assert.equal(fake.state.messages.warning.length, 1);
    assert.equal(fake.state.messages.error.length, 0);
    assert.equal(completes(s).length, 0);
  });
});
