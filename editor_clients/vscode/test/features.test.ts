// Against the real server: the cache, the context and its stability, privacy
// (excluded files, your globs beside the sensitive-file list, the token in the
// secret storage), priming, the next line fetched after an accept,
// alternatives (`n`), `feedback` for a completion never shown, the status
// bar's spinner, completing beside the suggest widget, and how long a request
// is waited for.

import './vscode-hook';

import assert from 'node:assert/strict';
import { after, afterEach, before, describe, it } from 'node:test';

import { SECRET_KEY } from '../src/secrets';
import { CancellationTokenSource, fake, InlineCompletionTriggerKind, Position, Range, Uri } from './fake-vscode';
import { Msg, Server, waitFor } from './server';
import {
  activateAgain, closeSession, completes, feedbackFor, primes, Session, speculative, start as startOn, suggestion, wire,
} from './session';

const TOKEN = 'vscode-features-test-token';
let server: Server;

/** Every session here gets the token from the setting (moved into the secret storage at once). */
const start = (config: Record<string, unknown> = {}) => startOn(server, { 'completer.token': TOKEN, ...config });

/** Type `text`, one keystroke at a time, each one's provider call done before the next. */
async function typeSlowly(text: string): Promise<void> {
  for (const ch of text) {
    await Promise.all(fake.type(ch));
  }
}

before(async () => {
  server = await Server.start(TOKEN);
});

after(async () => {
  await server?.stop();
});

afterEach(() => closeSession());

describe('the cache', () => {
  it('backspace to a place seen before shows its completion again, without a request; so does retyping', async () => {
    const s = await start();
    const shown = await suggestion(s, (t) => t.length >= 2 && t[0] !== '§', 'cache');
    await Promise.all(fake.type('§')); // not what it says: dismissed, and a request for the new place
    assert.deepEqual(feedbackFor(s, shown.id).map((m) => m.accepted_chars), [0]);
    const requests = completes(s).length;

    const [back] = await Promise.all(fake.type('\b'));
    assert.deepEqual(back?.map((i) => [i.insertText, i.command?.arguments]), [[shown.text, [shown.id, 0]]]);
    assert.equal(s.api.stats.cacheHits, 1);
    await fake.commandsRun('completer.dismiss');

    // Typing what it says, with nothing on screen: found a character back on the line.
    const [retyped] = await Promise.all(fake.type(shown.text[0]));
    assert.equal(retyped?.[0]?.insertText, shown.text.slice(1));
    assert.equal(completes(s).length, requests, 'no request since the first place');
    assert.equal(s.api.stats.cacheHits, 2);
    assert.equal(feedbackFor(s, shown.id).length, 1, 'reported once: the server forgot it');
  });
});

describe('context', () => {
  it('edited regions and open documents of the same language, not excluded ones, unchanged while typing', async () => {
    const s = await start({ 'completer.context.maxChars': 300, 'completer.debounce.minMs': 0, 'completer.debounce.maxMs': 0 });
    const helpers = fake.open('file:///proj/app/helpers.py', 'python',
      'import os\n\n\ndef home():\n    return os.environ["HOME"]\n|\n\n' + 'X = 1\n'.repeat(40));
    fake.insertAtCursor(helpers, 'def cwd():\n    return os.getcwd()\n'); // an edit (a paste)
    fake.open('file:///proj/app/util.js', 'javascript', 'export const cwd = () => process.cwd();\n');
    fake.open('file:///proj/app/.env', 'python', 'API_KEY = "sk-live-0123456789"\n'); // as if .env files were Python
    fake.open('file:///proj/app/main.py', 'python', 'import helpers\n\n\ndef run():\n    path = |\n');
    const sentBefore = completes(s).length;
    await typeSlowly('Zq9'); // characters no suggestion is likely to begin with: a request each
    const sent = completes(s).slice(sentBefore);
    assert.ok(sent.length >= 2, `a request per keystroke: ${sent.length}`);
    const context = sent[0].context as { uri: string; text: string }[];
    assert.equal(context[0]?.uri, 'file:///proj/app/helpers.py', JSON.stringify(context));
    assert.ok(context[0].text.includes('def cwd():\n    return os.getcwd()'), 'the edited region, as edited');
    assert.ok(context.every((c) => c.uri.endsWith('.py') && !c.uri.endsWith('.env')), JSON.stringify(context));
    for (const m of sent) {
      assert.deepEqual(m.context, context, 'the same context on every keystroke');
    }
    assert.equal(helpers.document.uri.toString(), context[0].uri);
    const lastDone = (await wire(s, sent.at(-1)?.id as string)).done;
    if (lastDone.type === 'done' && lastDone.reason !== 'cancelled') {
      const t = lastDone.timings as { prompt_tokens: number; cached_tokens: number };
      assert.ok(t.cached_tokens >= t.prompt_tokens / 2, `the context stayed cached: ${JSON.stringify(t)}`);
    }
  });
});

describe('context kinds, workspace, definitions', () => {
  it('items carry their kind, requests their workspace folder, and imported names\' definitions go along', async () => {
    const s = await start({ 'completer.debounce.minMs': 0, 'completer.debounce.maxMs': 0 });
    fake.state.workspaceFolders = ['file:///proj'];
    fake.state.files.set('file:///proj/pkg/shapes.py', { languageId: 'python',
      text: 'import math\n\n\ndef area_of_circle(radius):\n    return math.pi * radius * radius\n' });
    fake.state.files.set('file:///proj/pkg/.env', { languageId: 'python', text: 'API_KEY = "sk-live-0123"\n' });
    const lookups: string[] = [];
    // The language server's part: VS Code's command asks it; here it answers from what it was told.
    fake.state.commands.set('vscode.executeDefinitionProvider', (uri: { toString(): string }, pos: { line: number }) => {
      lookups.push(`${uri.toString()}:${pos.line}`);
      return [{ uri: Uri.parse(pos.line === 0 ? 'file:///proj/pkg/shapes.py' : 'file:///proj/pkg/.env'),
        range: new Range(new Position(pos.line === 0 ? 3 : 0, 0), new Position(pos.line === 0 ? 3 : 0, 4)) }];
    });
    const helpers = fake.open('file:///proj/app/helpers.py', 'python', 'import os\n\n\ndef home():\n    return os.environ["HOME"]\n|\n');
    fake.insertAtCursor(helpers, 'def cwd():\n    return os.getcwd()\n'); // an edit
    const main = 'file:///proj/app/main.py';
    fake.open(main, 'python', 'from pkg.shapes import area_of_circle\nfrom pkg.env import API_KEY\n\n\ndef report(r):\n    return |\n');
    await waitFor(() => s.api.definitions.forRequest(main).length > 0, 'the definitions looked up');
    const sentBefore = completes(s).length;
    await typeSlowly('Zq9');
    const sent = completes(s).slice(sentBefore);
    assert.ok(sent.length >= 1);
    for (const m of sent) {
      assert.equal(m.workspace, 'file:///proj');
      const context = m.context as { uri: string; text: string; kind: string }[];
      assert.deepEqual(context.map((c) => [c.uri, c.kind]), [['file:///proj/app/helpers.py', 'edit'],
        ['file:///proj/pkg/shapes.py', 'definition']], JSON.stringify(context));
      assert.ok(context[1].text.startsWith('def area_of_circle(radius):'), context[1].text);
    }
    const ofMain = lookups.filter((l) => l.startsWith(main));
    assert.deepEqual(ofMain, [`${main}:0`, `${main}:1`], 'one lookup per imported name, not one per keystroke');
    assert.ok(!s.sent.some((m) => JSON.stringify(m).includes('sk-live')), 'the secret never left');
    // The real server took the new fields: the request ended with `done`, not an error.
    const lastDone = (await wire(s, sent.at(-1)?.id as string)).done;
    assert.equal(lastDone.type, 'done', JSON.stringify(lastDone));
    // A document outside every workspace folder names none.
    fake.open('file:///elsewhere/x.py', 'python', 'y = |\n');
    const before = completes(s).length;
    await typeSlowly('Zq');
    assert.ok(completes(s).slice(before).every((m) => m.workspace === undefined));
  });
});

describe('privacy', () => {
  it('a .env document is neither completed nor read as context', async () => {
    const s = await start({ 'completer.languages': { '*': true, markdown: false } });
    const env = fake.open('file:///proj/app/.env', 'dotenv', 'API_KEY=sk-live-0123456789\nDB_URL=|\n');
    assert.equal(await fake.trigger(InlineCompletionTriggerKind.Invoke), undefined);
    await typeSlowly('pos');
    fake.open('file:///proj/README.md', 'markdown', '# app\n\nRun it with |\n');
    assert.equal(await fake.trigger(InlineCompletionTriggerKind.Invoke), undefined);
    assert.equal(s.sent.filter((m) => m.type === 'complete').length, 0, 'no request, not even a priming one');

    // Another document: the .env file's text is in no frame sent.
    fake.activate(env);
    fake.open('file:///proj/app/defaults.conf', 'dotenv', 'LOG_LEVEL=info\nKEY=|\n'); // not sensitive, same language
    await fake.trigger(InlineCompletionTriggerKind.Invoke);
    assert.equal(completes(s).length, 1);
    assert.ok(!s.sent.some((m) => JSON.stringify(m).includes('sk-live')), 'the secret never left');
  });

  it('completer.exclude adds to the sensitive-file list; excludeSensitiveFiles: false alone drops that list', async () => {
    const s = await start({ 'completer.exclude': ['**/generated/**', '*.gen.py'] });
    assert.deepEqual(s.api.settings().exclude, ['**/generated/**', '*.gen.py']);
    for (const uri of ['file:///proj/app/.env', 'file:///proj/app/server.pem', 'file:///proj/generated/models.py',
      'file:///proj/app/schema.gen.py']) {
      fake.open(uri, 'python', 'import os\nx = |\n');
      assert.equal(await fake.trigger(InlineCompletionTriggerKind.Invoke), undefined, uri);
    }
    assert.equal(s.sent.filter((m) => m.type === 'complete').length, 0, 'the user\'s globs did not replace the defaults');
    fake.open('file:///proj/app/main.py', 'python', 'import os\nx = |\n');
    await fake.trigger(InlineCompletionTriggerKind.Invoke);
    assert.equal(completes(s).length, 1, 'a file neither list names is completed');

    fake.setConfig({ 'completer.excludeSensitiveFiles': false });
    await new Promise((r) => setImmediate(r));
    fake.open('file:///proj/app/.env', 'python', 'import os\nx = |\n');
    await fake.trigger(InlineCompletionTriggerKind.Invoke);
    assert.equal(completes(s).at(-1)?.document?.uri, 'file:///proj/app/.env', 'the opt-out lets .env through');
    fake.open('file:///proj/generated/more.py', 'python', 'import os\nx = |\n');
    const before = completes(s).length;
    assert.equal(await fake.trigger(InlineCompletionTriggerKind.Invoke), undefined);
    assert.equal(completes(s).length, before, 'the user\'s own globs still hold');
  });

  it('the token lives in the secret storage: moved from the setting, used, set by command', async () => {
    const s = await startOn(server, { 'completer.token': TOKEN, 'completer.tokenFile': '/nonexistent/token',
      'completer.reconnect.maxDelayMs': 300 });
    assert.equal(fake.state.secrets.values.get(SECRET_KEY), TOKEN);
    assert.ok(!('completer.token' in fake.state.config), 'the setting (which Settings Sync copies) is cleared');
    assert.ok(s.api.client.connected);

    const again = await activateAgain(); // a new window: only the secret storage has the token
    fake.state.inputAnswers.push('a-wrong-token-0123456789');
    await fake.commandsRun('completer.setToken');
    assert.equal(fake.state.secrets.values.get(SECRET_KEY), 'a-wrong-token-0123456789');
    await waitFor(() => again.api.client.state === 'disconnected' && /401/.test(fake.state.statusItems.at(-1)?.tooltip ?? ''),
      'the new token refused');
    fake.state.inputAnswers.push(TOKEN);
    await fake.commandsRun('completer.setToken');
    await waitFor(() => again.api.client.connected, 'the right token used at once');
  });
});

describe('the server\'s newer fields', () => {
  it('priming: a document opened or made active has its prompt prefilled, with nothing generated', async () => {
    const s = await start();
    const a = fake.open('file:///proj/app/prime_a.py', 'python', 'import os\n\n\ndef main():\n    |\n');
    const first = await waitFor(() => primes(s)[0], 'a priming request');
    assert.equal(first.document?.uri, 'file:///proj/app/prime_a.py');
    const { deltas, done } = await wire(s, first.id as string);
    assert.deepEqual([done.type, done.text, deltas], ['done', '', []]);
    fake.open('file:///proj/app/prime_b.py', 'python', 'x = 1\n|');
    fake.activate(a);
    await waitFor(() => primes(s).length === 3, 'a priming request per switch');
    assert.deepEqual(primes(s).map((m) => m.document?.uri),
      ['file:///proj/app/prime_a.py', 'file:///proj/app/prime_b.py', 'file:///proj/app/prime_a.py']);
    await wire(s, primes(s)[2].id as string);
    await fake.trigger(InlineCompletionTriggerKind.Invoke);
    const request = completes(s).at(-1) as Msg;
    const t = (await wire(s, request.id as string)).done.timings as { prompt_tokens: number; cached_tokens: number };
    // The server caches whole K/V blocks (engine.block_size, 16 tokens): all but the last, partial one.
    assert.ok(t.prompt_tokens > 16 && t.cached_tokens >= t.prompt_tokens - 16, `the prompt was cached: ${JSON.stringify(t)}`);
    assert.equal(s.api.stats.requests, 1, 'priming is not counted as a request');
  });

  it('after a whole accept at the end of a line, the next line is asked for beside it (supersede: false)', async () => {
    const s = await start();
    const shown = await suggestion(s, (t) => t.length > 0 && !t.includes('\n'), 'next', [
      'def area(width, height):\n    return |\n', 'import sys\n\n\ndef main(argv):\n    args = |\n', 'import |\n',
    ]);
    await fake.commandsRun('editor.action.inlineSuggest.commit');
    const spec = await waitFor(() => speculative(s)[0], 'the next line asked for');
    const line = shown.before.slice(0, shown.cursor).split('\n').at(-1) as string;
    const indent = /^\s*/.exec(line)?.[0] ?? '';
    const accepted = shown.before.slice(0, shown.cursor) + shown.text;
    assert.equal(spec.document?.prefix, `${accepted}\n${/[:{([]\s*$/.test(line + shown.text) ? `${indent}    ` : indent}`);
    const { done } = await wire(s, spec.id as string);
    const requests = completes(s).length;
    const items = await fake.trigger(InlineCompletionTriggerKind.Automatic); // VS Code asks again after the accept
    assert.equal(completes(s).length, requests, 'no request of its own: the next line is the answer');
    if (String(done.text).trim()) {
      const lead = (spec.document?.prefix ?? '').slice(accepted.length);
      assert.equal(items?.[0]?.insertText, lead + String(done.text));
      await typeSlowly(lead); // Enter, then the indentation: typed through
      assert.equal(completes(s).length, requests);
    } else {
      assert.equal(items, undefined);
    }
  });

  it('n: the candidates are offered as alternatives, and feedback says which was kept', async () => {
    const s = await start({ 'completer.candidates': 3 });
    const shown = await suggestion(s, () => (fake.state.ghost?.items.length ?? 0) > 1, 'alternatives');
    const request = completes(s).find((m) => m.id === shown.id) as Msg;
    assert.equal(request.n, 3);
    const done = (await wire(s, shown.id)).done;
    const offered = [done.text as string, ...(done.candidates as string[])];
    const items = fake.state.ghost?.items ?? [];
    assert.deepEqual(items.map((i) => i.insertText), offered.filter((t, i) => t.trim() && offered.indexOf(t) === i));
    await fake.commandsRun('editor.action.inlineSuggest.showNext');
    const second = items[1].command?.arguments as [string, number];
    await fake.commandsRun('editor.action.inlineSuggest.commit');
    assert.deepEqual(feedbackFor(s, shown.id), [{
      type: 'feedback', id: shown.id, accepted_chars: [...offered[second[1]]].length, typed_chars: 0, shown: true,
      candidate: second[1],
    }]);
  });

  it('a completion that came too late to be shown is reported as never shown', async () => {
    // (The edit would send its own request at once, superseding this one: keystroke.test.ts has that case.)
    const s: Session = await start({ 'completer.cache.size': 0, 'completer.requestOnKeystroke': false });
    const editor = fake.open('file:///proj/app/late.py', 'python', 'for i in range(10):\n|\n');
    const items = fake.trigger(InlineCompletionTriggerKind.Invoke);
    fake.insertAtCursor(editor, '#', false); // an edit that does not cancel the call (a formatter, say)
    assert.equal(await items, undefined);
    const id = completes(s).at(-1)?.id as string;
    const { done } = await wire(s, id);
    if (String(done.text).trim()) {
      assert.deepEqual(feedbackFor(s, id), [{ type: 'feedback', id, accepted_chars: 0, typed_chars: 0, shown: false }]);
    } else {
      assert.deepEqual(feedbackFor(s, id), [], 'nothing to report of an empty completion');
    }
  });
});

describe('the generating indicator, the suggest widget, request timeouts (#28)', () => {
  it('the status item spins while a suggestion is generated, and stops on done, cancel, error and timeout', async () => {
    const s = await start({ 'completer.prime': false });
    const item = fake.state.statusItems[0];
    const spinning = () => item.text === '$(loading~spin) completer';
    const idle = () => !item.text.includes('loading');
    // A document per case: nothing shown nor cached from the case before.
    let n = 0;
    const open = () => fake.open(`file:///proj/app/spin_${n++}.py`, 'python', 'import os\n\n\ndef read_lines(path):\n|\n');
    open();

    // done
    let call = fake.trigger(InlineCompletionTriggerKind.Invoke);
    assert.ok(spinning(), `spinning while the request is in flight: ${item.text}`);
    assert.equal(s.api.client.generating, 1);
    assert.match(item.tooltip ?? '', /generating a suggestion/);
    await call;
    let id = completes(s).at(-1)?.id as string;
    assert.notEqual((await wire(s, id)).done.reason, 'cancelled');
    assert.ok(idle() && /^\$\(zap\) completer \d+ ms$/.test(item.text), item.text);

    // cancelled (a keystroke): off at once, before the server's `done`
    open();
    const cts = new CancellationTokenSource();
    call = fake.trigger(InlineCompletionTriggerKind.Invoke, cts);
    id = completes(s).at(-1)?.id as string;
    assert.ok(spinning(), item.text);
    cts.cancel();
    assert.ok(idle(), `off as soon as cancelled: ${item.text}`);
    assert.equal(s.api.client.generating, 0);
    await call;
    await wire(s, id);
    assert.ok(idle(), item.text);

    // an error (deadline_ms beyond the protocol's bound: bad_request)
    open();
    fake.setConfig({ 'completer.deadlineMs': 700_000 });
    await new Promise((r) => setImmediate(r));
    const texts = item.texts.length;
    assert.equal(await fake.trigger(InlineCompletionTriggerKind.Invoke), undefined);
    id = completes(s).at(-1)?.id as string;
    assert.equal((await wire(s, id)).done.code, 'bad_request');
    assert.ok(item.texts.slice(texts).includes('$(loading~spin) completer'), `it spun: ${JSON.stringify(item.texts.slice(texts))}`);
    assert.equal(item.text, '$(warning) completer: error');

    // a timeout: completer.requestTimeoutMs overrides the deadline
    open();
    fake.setConfig({ 'completer.deadlineMs': 0, 'completer.requestTimeoutMs': 1 });
    await new Promise((r) => setImmediate(r));
    const sentAt = performance.now();
    assert.equal(await fake.trigger(InlineCompletionTriggerKind.Invoke), undefined);
    const waited = performance.now() - sentAt;
    const timedOut = s.results.at(-1);
    assert.equal(timedOut?.reason, 'timeout');
    assert.ok(waited < 1_000, `given up after ${waited} ms`);
    assert.ok(idle(), item.text);
    assert.match(item.tooltip ?? '', /timeout: no answer from the server within 1 ms/);
    assert.ok(fake.state.output.some((l) => l.includes(`request ${timedOut?.id}: timeout`)), fake.state.output.join('\n'));

    // back to the default: deadline plus margin, and the server answers in time
    open();
    fake.setConfig({ 'completer.requestTimeoutMs': 0 });
    await new Promise((r) => setImmediate(r));
    await fake.trigger(InlineCompletionTriggerKind.Invoke);
    assert.notEqual(s.results.at(-1)?.reason, 'timeout');
    assert.ok(idle() && !item.text.includes('error'), item.text);
  });

  it('the server announces its deadlines (first request of a document, and the others) in its ready', async () => {
    const s = await start();
    const request = await waitFor(() => s.api.client.server?.request, 'the server\'s ready');
    assert.equal(request.deadline_ms, 2000);
    assert.equal(request.first_deadline_ms, 15000);
  });

  it('with the suggest widget open, the suggestion starts with its selected item, asked for as if it were inserted', async () => {
    const s = await start({ 'completer.prime': false });
    // The text before the cursor, the word typed so far, and the item the widget selected for it.
    const cases: [string, string, string][] = [
      ['import os\n\n\ndef read_lines(path):\n    with open(', 'pa', 'path'],
      ['def area(width, height):\n    return ', 'wid', 'width'],
      ['import sys\n\n\ndef main(argv):\n    args = ', 'sys.ar', 'sys.argv'],
      ['import os\n\n\ndef main():\n    ', 'pri', 'print'],
      ['class Stack:\n    def push(self, item):\n        ', 'se', 'self'],
      ['for i in ', 'ra', 'range'],
    ];
    let n = 0;
    for (const [before, typed, word] of cases) {
      const editor = fake.open(`file:///proj/app/widget_${n++}.py`, 'python', `${before}${typed}|\n`);
      const doc = editor.document;
      const range = new Range(doc.positionAt(before.length), doc.positionAt(before.length + typed.length));
      const selected = { range, text: word };
      const items = await fake.trigger(InlineCompletionTriggerKind.Invoke, undefined, selected);
      const request = completes(s).at(-1) as Msg;
      assert.equal(request.document?.prefix, before + word, 'the prefix as if the item were inserted');
      assert.equal(request.document?.suffix, '\n');
      const { done } = await wire(s, request.id as string);
      if (!items || items.length === 0) {
        assert.equal(String(done.text).trim(), '', `a completion was not offered: ${JSON.stringify(done)}`);
        fake.close(editor);
        continue;
      }
      assert.equal(items[0].insertText, word + String(done.text));
      for (const offered of items) {
        assert.ok(offered.insertText.startsWith(word), offered.insertText);
        assert.ok(offered.range?.start.isEqual(range.start) && offered.range.end.isEqual(range.end), 'over the item\'s range');
      }
      // Asked again with the widget still open (its item unchanged): the same, no request.
      const requests = completes(s).length;
      const again = await fake.trigger(InlineCompletionTriggerKind.Automatic, undefined, selected);
      assert.deepEqual(again?.map((i) => i.insertText), items.map((i) => i.insertText));
      // The item is inserted: the rest shows at once, without a request, and Tab takes it.
      fake.acceptSuggestItem(editor, selected);
      const after = await fake.trigger(InlineCompletionTriggerKind.Automatic);
      assert.equal(after?.[0]?.insertText, done.text);
      assert.equal(completes(s).length, requests, 'no request once the item is in');
      await fake.commandsRun('editor.action.inlineSuggest.commit');
      assert.equal(doc.getText(), `${before}${word}${String(done.text)}\n`);
      assert.deepEqual(feedbackFor(s, request.id as string).map((m) => [m.accepted_chars, m.shown]),
        [[[...String(done.text)].length, true]]);
      return;
    }
    throw new Error(`no case gave a completion: ${JSON.stringify(s.received.filter((m) => m.type === 'done').map((m) => m.text))}`);
  });
});
