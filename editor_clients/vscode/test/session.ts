// The extension activated on a fresh fake workbench against a real server,
// with what it sent and received on the wire; the helpers the tests share.

import './vscode-hook';

import assert from 'node:assert/strict';

import type { CompletionResult } from '../src/client';
import type * as vscode from 'vscode';

import { activate, CompleterApi, deactivate } from '../src/extension';
import { fake, FakeEditor, InlineCompletionTriggerKind } from './fake-vscode';
import { Msg, Server, waitFor } from './server';

export interface Session {
  api: CompleterApi;
  sent: Msg[];
  received: Msg[];
  results: CompletionResult[];
  close(): void;
}

let open: Session | undefined;

/** Activate the extension on a fresh fake workbench (the token: the setting given, or the token file). */
export async function start(server: Server, config: Record<string, unknown> = {}, connect = true): Promise<Session> {
  fake.reset({ 'completer.serverUrl': server.url, ...config });
  return activateAgain(connect);
}

/** Activate the extension again on the same workbench (its settings and secret storage). */
export async function activateAgain(connect = true): Promise<Session> {
  closeSession();
  const context = fake.context();
  const sent: Msg[] = [];
  const received: Msg[] = [];
  const results: CompletionResult[] = [];
  const api = await activate(context as unknown as vscode.ExtensionContext);
  const s: Session = {
    api, sent, received, results,
    close: () => {
      context.subscriptions.forEach((d) => d.dispose());
      deactivate();
    },
  };
  api.client.on('sent', (m: Msg) => sent.push(m));
  api.client.on('message', (m: Msg) => received.push(m));
  api.client.on('result', (r: CompletionResult) => results.push(r));
  open = s;
  if (connect) {
    await waitFor(() => api.client.connected, 'the client to connect');
  }
  return s;
}

export function closeSession(): void {
  open?.close();
  open = undefined;
}

/** The requests for a suggestion (not those priming the cache, nor the next lines fetched after an accept). */
export const completes = (s: Session) => s.sent.filter((m) => m.type === 'complete' && m.max_tokens !== 0 && m.supersede !== false);
export const primes = (s: Session) => s.sent.filter((m) => m.type === 'complete' && m.max_tokens === 0);
export const speculative = (s: Session) => s.sent.filter((m) => m.type === 'complete' && m.supersede === false);
export const feedbackFor = (s: Session, id: string) => s.sent.filter((m) => m.type === 'feedback' && m.id === id);

/** The terminal message of request `id` as received on the wire, and the deltas before it. */
export async function wire(s: Session, id: string, timeoutMs = 15_000): Promise<{ deltas: string[]; done: Msg }> {
  const done = await waitFor(() => s.received.find((m) => m.id === id && (m.type === 'done' || m.type === 'error')),
    `the end of request ${id}`, timeoutMs);
  return { deltas: s.received.filter((m) => m.id === id && m.type === 'delta').map((m) => m.text as string), done };
}

// Cursor positions (`|`) the small default models answer with some text; block ones give longer text.
export const PROMPTS = [
  'import math\n\n\nclass Circle:\n    def __init__(self, radius):\n|\n',
  'class Stack:\n    def push(self, item):\n|\n',
  'import os\n\n\ndef read_lines(path):\n|\n',
  'def area(width, height):\n    return |\n',
  'import sys\n\n\ndef main(argv):\n    args = |\n',
  'for i in range(10):\n|\n',
];

export interface ShownSuggestion {
  editor: FakeEditor;
  id: string;
  text: string;
  /** The document before the suggestion, and the cursor. */
  before: string;
  cursor: number;
}

/** Open prompts until the provider shows a suggestion for which `want` holds. */
export async function suggestion(s: Session, want: (text: string) => boolean, name: string,
  prompts = PROMPTS): Promise<ShownSuggestion> {
  let n = 0;
  for (const prompt of prompts) {
    const editor = fake.open(`file:///proj/app/${name}_${n++}.py`, 'python', prompt);
    const items = await fake.trigger(InlineCompletionTriggerKind.Invoke);
    const id = completes(s).at(-1)?.id as string;
    const { deltas, done } = await wire(s, id);
    assert.equal(deltas.join(''), done.text, 'deltas concatenate to done.text');
    if (items && items.length > 0) {
      const item = items[0];
      assert.equal(item.insertText, done.text, 'the editor shows exactly what the server sent');
      assert.deepEqual(item.command?.arguments, [id, 0]);
      if (want(item.insertText)) {
        return { editor, id, text: item.insertText, before: editor.document.getText(), cursor: editor.cursor };
      }
    } else {
      assert.equal((done.text as string).trim(), '', `a non-empty completion was not shown: ${JSON.stringify(done)}`);
    }
    fake.close(editor);
  }
  throw new Error(`no prompt gave a suggestion as wanted (${name}); completions: `
    + JSON.stringify(s.received.filter((m) => m.type === 'done').map((m) => m.text)));
}

/** Characters as the server counts them (code points). */
export const chars = (text: string) => [...text].length;

export async function counters(server: Server): Promise<{ shown: number; accepted: number }> {
  return {
    shown: await server.counter('completer_feedback_shown_chars_total'),
    accepted: await server.counter('completer_feedback_accepted_chars_total'),
  };
}

/**
 * The server's feedback counters move by exactly what this session's feedback
 * frames say: a shown completion adds its length (code points) to the shown
 * characters, and what was kept (accepted or typed through, at most that
 * length) to the accepted ones; one never shown adds nothing.
 */
export async function countersMatch(server: Server, s: Session, before: { shown: number; accepted: number }): Promise<void> {
  const frames = s.sent.filter((m) => m.type === 'feedback' && m.shown !== false);
  const offered = (id: string) => chars(s.received.find((m) => m.id === id && m.type === 'done')?.text as string);
  const want = {
    shown: before.shown + frames.reduce((n, m) => n + offered(m.id as string), 0),
    accepted: before.accepted + frames.reduce((n, m) => n
      + Math.min(offered(m.id as string), (m.accepted_chars as number) + (m.typed_chars as number)), 0),
  };
  let got = {};
  try {
    await waitFor(async () => {
      got = await counters(server);
      return JSON.stringify(got) === JSON.stringify(want);
    }, 'the server to count the feedback', 5000);
  } catch (e) {
    throw new Error(`server counters ${JSON.stringify(got)}, expected ${JSON.stringify(want)}: ${String(e)}`);
  }
}

export const insertedAt = (shown: ShownSuggestion, text: string) =>
  shown.before.slice(0, shown.cursor) + text + shown.before.slice(shown.cursor);
