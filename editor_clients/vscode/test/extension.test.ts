// The extension against the real server (default models, ephemeral port),
// with only the `vscode` module replaced. The models are small: every check
// compares what the editor got with what the server sent, never expected code.

import './vscode-hook';

import assert from 'node:assert/strict';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { after, afterEach, before, describe, it } from 'node:test';

import type { CompletionResult } from '../src/client';
import type * as vscode from 'vscode';

import { activate, CompleterApi, deactivate } from '../src/extension';
import { CancellationTokenSource, fake, FakeEditor, InlineCompletionItem, InlineCompletionTriggerKind, nextWord } from './fake-vscode';
import { Msg, Server, waitFor } from './server';


const TOKEN = 'vscode-extension-test-token';
let server: Server;
let configHome: string;

interface Session {
  api: CompleterApi;
  sent: Msg[];
  received: Msg[];
  results: CompletionResult[];
  close(): void;
}
let session: Session | undefined;

/** Activate the extension on a fresh fake workbench; the token comes from the token file (XDG_CONFIG_HOME). */
async function start(config: Record<string, unknown> = {}, connect = true): Promise<Session> {
  fake.reset({ 'completer.serverUrl': server.url, ...config });
  const context = { subscriptions: [] as { dispose(): unknown }[] };
  const api = activate(context as unknown as vscode.ExtensionContext);
  const s: Session = {
    api, sent: [], received: [], results: [],
    close: () => {
      context.subscriptions.forEach((d) => d.dispose());
      deactivate();
    },
  };
  api.client.on('sent', (m: Msg) => s.sent.push(m));
  api.client.on('message', (m: Msg) => s.received.push(m));
  api.client.on('result', (r: CompletionResult) => s.results.push(r));
  session = s;
  if (connect) {
    await waitFor(() => api.client.connected, 'the client to connect');
  }
  return s;
}

const completes = (s: Session) => s.sent.filter((m) => m.type === 'complete');
const feedbackFor = (s: Session, id: string) => s.sent.filter((m) => m.type === 'feedback' && m.id === id);

/** The terminal message of request `id` as received on the wire, and the deltas before it. */
async function wire(s: Session, id: string): Promise<{ deltas: string[]; done: Msg }> {
  const done = await waitFor(() => s.received.find((m) => m.id === id && (m.type === 'done' || m.type === 'error')),
    `the end of request ${id}`);
  return { deltas: s.received.filter((m) => m.id === id && m.type === 'delta').map((m) => m.text as string), done };
}

// Cursor positions (`|`) the small default models answer with some text; block ones give longer text.
const PROMPTS = [
  'import math\n\n\nclass Circle:\n    def __init__(self, radius):\n|\n',
  'class Stack:\n    def push(self, item):\n|\n',
  'import os\n\n\ndef read_lines(path):\n|\n',
  'def area(width, height):\n    return |\n',
  'import sys\n\n\ndef main(argv):\n    args = |\n',
  'for i in range(10):\n|\n',
];

interface Shown {
  editor: FakeEditor;
  id: string;
  text: string;
  /** The document before the suggestion, and the cursor. */
  before: string;
  cursor: number;
}

/** Open prompts until the provider shows a suggestion for which `want` holds. */
async function suggestion(s: Session, want: (text: string) => boolean, name: string): Promise<Shown> {
  let n = 0;
  for (const prompt of PROMPTS) {
    const editor = fake.open(`file:///proj/app/${name}_${n++}.py`, 'python', prompt);
    const items = await fake.trigger(InlineCompletionTriggerKind.Invoke);
    const id = completes(s).at(-1)?.id as string;
    const { deltas, done } = await wire(s, id);
    assert.equal(deltas.join(''), done.text, 'deltas concatenate to done.text');
    if (items && items.length > 0) {
      const item = items[0];
      assert.equal(item.insertText, done.text, 'the editor shows exactly what the server sent');
      assert.deepEqual(item.command?.arguments, [id]);
      if (want(item.insertText)) {
        return { editor, id, text: item.insertText, before: editor.document.getText(), cursor: editor.cursor };
      }
    } else {
      assert.equal((done.text as string).trim(), '', `a non-empty completion was not shown: ${JSON.stringify(done)}`);
    }
    fake.state.editors = fake.state.editors.filter((e) => e !== editor);
  }
  throw new Error(`no prompt gave a suggestion as wanted (${name}); completions: `
    + JSON.stringify(s.received.filter((m) => m.type === 'done').map((m) => m.text)));
}

/** The server's feedback counters move by exactly what this session's feedback frames say. */
async function countersMatch(s: Session, before: { shown: number; accepted: number }): Promise<void> {
  const frames = s.sent.filter((m) => m.type === 'feedback');
  const shownText = (id: string) => (s.received.find((m) => m.id === id && m.type === 'done')?.text as string).length;
  const want = {
    shown: before.shown + frames.reduce((n, m) => n + shownText(m.id as string), 0),
    accepted: before.accepted + frames.reduce((n, m) => n + (m.accepted_chars as number), 0),
  };
  let got = {};
  try {
    await waitFor(async () => {
      got = await counters();
      return JSON.stringify(got) === JSON.stringify(want);
    }, 'the server to count the feedback', 5000);
  } catch (e) {
    throw new Error(`server counters ${JSON.stringify(got)}, expected ${JSON.stringify(want)}: ${String(e)}`);
  }
}

async function counters(): Promise<{ shown: number; accepted: number }> {
  return {
    shown: await server.counter('completer_feedback_shown_chars_total'),
    accepted: await server.counter('completer_feedback_accepted_chars_total'),
  };
}

const insertedAt = (shown: Shown, text: string) => shown.before.slice(0, shown.cursor) + text + shown.before.slice(shown.cursor);

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

afterEach(() => {
  session?.close();
  session = undefined;
});

describe('completions from the real server', () => {
  it('streams: the suggestion is done.text, the deltas concatenated; prefix, suffix, mode and context are sent', async () => {
    const s = await start({ 'completer.context.maxChars': 200 });
    assert.equal(s.sent[0]?.type, 'hello');
    const other = Array.from({ length: 300 }, (_, i) => `VALUE_${i} = ${i}`).join('\n');
    const neighbour = fake.open('file:///proj/app/constants.py', 'python', other, false);
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
    assert.ok(context.length <= 3);

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
    assert.equal(s.api.provider.tracker.current?.accepted, word.length);
    assert.equal(feedbackFor(s, shown.id).length, 0, 'no feedback until the suggestion ends');
    if (fake.state.ghost) {
      await fake.commandsRun('completer.acceptNextLine');
    }
    if (fake.state.ghost) {
      await fake.commandsRun('editor.action.inlineSuggest.commit'); // Tab
    }
    assert.equal(shown.editor.document.getText(), insertedAt(shown, shown.text));
    assert.deepEqual(feedbackFor(s, shown.id), [{ type: 'feedback', id: shown.id, accepted_chars: shown.text.length }]);
    assert.equal(s.api.provider.tracker.current, undefined);
    await countersMatch(s, before);
    assert.equal(s.api.stats.acceptedWhole, 1);

    // Next word, then Escape: the accepted word is reported.
    const again = await suggestion(s, (t) => nextWord(t).length < t.length, 'partial');
    await fake.commandsRun('completer.acceptNextWord');
    await fake.commandsRun('completer.dismiss');
    assert.ok(fake.state.executed.some((e) => e.command === 'editor.action.inlineSuggest.hide'));
    assert.equal(fake.state.ghost, undefined);
    assert.deepEqual(feedbackFor(s, again.id), [{ type: 'feedback', id: again.id, accepted_chars: nextWord(again.text).length }]);
    assert.equal(s.api.stats.acceptedPartly, 1);
    await countersMatch(s, before);
  });

  it('dismiss (Escape, or typing something else) sends feedback 0', async () => {
    const s = await start();
    const before = await counters();
    const one = await suggestion(s, (t) => t.length > 0, 'dismiss');
    assert.equal(fake.state.contextKeys['completer.suggestionVisible'], true);
    await fake.commandsRun('completer.dismiss');
    assert.deepEqual(feedbackFor(s, one.id), [{ type: 'feedback', id: one.id, accepted_chars: 0 }]);
    assert.equal(fake.state.contextKeys['completer.suggestionVisible'], false);

    const two = await suggestion(s, (t) => t.length > 0, 'diverge');
    const other = two.text[0] === '§' ? '¤' : '§';
    await Promise.all(fake.type(other));
    assert.deepEqual(feedbackFor(s, two.id), [{ type: 'feedback', id: two.id, accepted_chars: 0 }]);
    assert.ok(s.sent.filter((m) => m.type === 'feedback').every((m) => m.accepted_chars === 0));
    await countersMatch(s, before);
    assert.equal(s.api.stats.dismissed, 2);
  });

  it('type-through: typing what the suggestion says keeps showing the rest without a request', async () => {
    const s = await start();
    const shown = await suggestion(s, (t) => t.length >= 3, 'typethrough');
    const requests = completes(s).length;
    const [a] = await Promise.all(fake.type(shown.text[0]));
    assert.deepEqual(a?.map((i: InlineCompletionItem) => [i.insertText, i.command?.arguments]), [[shown.text.slice(1), [shown.id]]]);
    const [b] = await Promise.all(fake.type(shown.text[1]));
    assert.equal(b?.[0]?.insertText, shown.text.slice(2));
    assert.equal(completes(s).length, requests, 'no new request');
    assert.equal(s.api.stats.typeThrough, 2);
    await fake.commandsRun('editor.action.inlineSuggest.commit'); // Tab on the rest
    assert.equal(shown.editor.document.getText(), insertedAt(shown, shown.text));
    assert.deepEqual(feedbackFor(s, shown.id), [{ type: 'feedback', id: shown.id, accepted_chars: shown.text.length - 2 }],
      'typed chars are not counted as accepted');
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
