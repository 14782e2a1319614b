// Against the real server: the request sent at a keystroke
// (`completer.requestOnKeystroke`), before VS Code calls the provider, and
// awaited by the call for that very state; any other call asks itself, and
// with the setting off nothing is sent before the call.

import './vscode-hook';

import assert from 'node:assert/strict';
import { after, afterEach, before, describe, it } from 'node:test';

import { fake, InlineCompletionTriggerKind, Selection } from './fake-vscode';
import { Msg, Server, waitFor } from './server';
import {
  closeSession, completes, feedbackFor, insertedAt, PROMPTS, start as startOn, suggestion, wire,
} from './session';

const TOKEN = 'vscode-keystroke-test-token';
let server: Server;

const start = (config: Record<string, unknown> = {}) => startOn(server, { 'completer.token': TOKEN, ...config });
const automatic = () => fake.trigger(InlineCompletionTriggerKind.Automatic);
const prefix = (m: Msg | undefined) => (m?.document as { prefix: string } | undefined)?.prefix;

before(async () => {
  server = await Server.start(TOKEN);
});

after(async () => {
  await server?.stop();
});

afterEach(() => closeSession());

describe('the request sent at the keystroke', () => {
  it('is sent by the edit, and the provider\'s call for that version and cursor shows its answer, sending none', async () => {
    const s = await start();
    const editor = fake.open('file:///proj/app/early.py', 'python', PROMPTS[3]);
    fake.insertAtCursor(editor, 'w');
    assert.equal(completes(s).length, 1, 'sent at the keystroke, before VS Code asks');
    const early = completes(s)[0];
    assert.ok(prefix(early)?.endsWith('    return w'), prefix(early));
    assert.equal(early.min_first_prob, undefined, 'typing: the server\'s confidence rules');
    const items = await automatic();
    assert.equal(completes(s).length, 1, 'the call took it');
    const { done } = await wire(s, early.id as string);
    assert.equal(done.reason === 'cancelled', false);
    if (String(done.text).trim()) {
      assert.deepEqual(items?.map((i) => [i.insertText, i.command?.arguments]), [[done.text, [early.id, 0]]]);
    } else {
      assert.equal(items, undefined);
    }
  });

  it('an opening bracket VS Code closes is sent at the keystroke, for the cursor between the two, and taken', async () => {
    const s = await start();
    const editor = fake.open('file:///proj/app/pair.py', 'python', PROMPTS[3]);
    fake.typeAutoClosed(editor, '()');
    assert.equal(completes(s).length, 1, 'sent at the keystroke');
    const early = completes(s)[0];
    assert.ok(prefix(early)?.endsWith('    return ('), prefix(early));
    assert.ok((early.document as { suffix: string }).suffix.startsWith(')'), 'the closing bracket after the cursor');
    await automatic();
    assert.equal(completes(s).length, 1, 'the call took it');
  });

  it('a call at another cursor, or for another version, asks itself; the next keystroke cancels one not taken', async () => {
    const s = await start({ 'completer.maxTokens': 200 });
    const editor = fake.open('file:///proj/app/other.py', 'python', PROMPTS[1]);
    fake.insertAtCursor(editor, ' ');
    const first = completes(s).at(-1) as Msg;
    const at = editor.document.positionAt(editor.cursor - 1);
    editor.selections = [new Selection(at, at)]; // the cursor moved back, the document as it was
    await automatic();
    assert.equal(completes(s).length, 2, 'another cursor: its own request');
    assert.equal(prefix(completes(s)[1]), prefix(first)?.slice(0, -1));

    fake.insertAtCursor(editor, 'x'); // a keystroke at the cursor: sent at once...
    const third = completes(s).at(-1) as Msg;
    assert.equal(completes(s).length, 3);
    const end = editor.document.getText().length;
    editor.document.edit(end, end, '#'); // ...then an edit after it, not at the cursor: a newer version, no keystroke
    assert.equal(completes(s).length, 3);
    assert.ok(s.sent.some((m) => m.type === 'cancel' && m.id === third.id) || s.received.some((m) => m.id === third.id),
      'the request of a state gone is cancelled (unless it had ended)');
    await automatic();
    assert.equal(completes(s).length, 4, 'another version: its own request');
    assert.equal(prefix(completes(s)[3]), prefix(third));
  });

  it('none while typing through a suggestion; typed to its end, the next one is asked for at the keystroke', async () => {
    const s = await start();
    const shown = await suggestion(s, (t) => t.length >= 2 && t.length <= 40 && !/[\r\n]/.test(t), 'through');
    const requests = completes(s).length;
    for (const ch of shown.text.slice(0, -1)) {
      const [rest] = await Promise.all(fake.type(ch));
      assert.ok(rest?.[0]?.insertText, 'the rest shown');
    }
    assert.equal(completes(s).length, requests, 'typing through: no request');
    fake.insertAtCursor(shown.editor, shown.text.slice(-1));
    assert.equal(completes(s).length, requests + 1, 'its last character: the next suggestion asked for at once');
    assert.equal(prefix(completes(s).at(-1)), insertedAt(shown, shown.text).slice(0, shown.cursor + shown.text.length));
  });

  it('not for what is not typing at the cursor, nor where the provider would not ask', async () => {
    const s = await start();
    const editor = fake.open('file:///proj/app/not.py', 'python', PROMPTS[4]);
    fake.insertAtCursor(editor, '\n');
    editor.document.edit(0, 0, '#'); // one character, but not where the cursor is (another extension, say)
    fake.select(editor, [editor.cursor, editor.cursor], [3, 3]);
    fake.insertAtCursor(editor, 'x');
    fake.select(editor, [editor.cursor - 1, editor.cursor]);
    fake.insertAtCursor(editor, 'y');
    assert.equal(completes(s).length, 0, 'a line break, an edit off the cursor, several cursors, a selection');
    fake.insertAtCursor(fake.open('file:///proj/app/.env', 'plaintext', 'KEY=|\n'), 'v');
    const behind = fake.open('file:///proj/app/behind.py', 'python', 'x = |\n', false);
    behind.document.edit(behind.cursor, behind.cursor, 'z');
    assert.equal(completes(s).length, 0, 'an excluded file; a document not in the active editor');
  });

  it('with completer.requestOnKeystroke off, nothing is sent before the provider\'s call', async () => {
    const s = await start({ 'completer.requestOnKeystroke': false });
    const editor = fake.open('file:///proj/app/off.py', 'python', PROMPTS[3]);
    fake.insertAtCursor(editor, 'w');
    assert.equal(completes(s).length, 0);
    await automatic();
    assert.equal(completes(s).length, 1, 'asked by the call, as before');
    assert.ok(prefix(completes(s)[0])?.endsWith('    return w'));
  });

  it('an answer no call took, not cached, is reported as never shown once the next keystroke drops it', async () => {
    const s = await start({ 'completer.cache.size': 0 });
    const editor = fake.open('file:///proj/app/dropped.py', 'python', 'for i in range(10):\n|\n');
    fake.insertAtCursor(editor, ' ');
    const id = completes(s).at(-1)?.id as string;
    const { done } = await wire(s, id);
    fake.insertAtCursor(editor, '\n');
    if (String(done.text).trim()) {
      await waitFor(() => feedbackFor(s, id).length > 0, 'the feedback');
      assert.deepEqual(feedbackFor(s, id), [{ type: 'feedback', id, accepted_chars: 0, typed_chars: 0, shown: false }]);
    } else {
      assert.deepEqual(feedbackFor(s, id), [], 'nothing to report of an empty completion');
    }
  });
});
