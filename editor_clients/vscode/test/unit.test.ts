// The pure parts: mode choice, bounds, nearby text, debounce, the token, the
// shown-suggestion tracker and its counts, the cache, privacy, the context,
// liveness on a fake clock, which edits are keystrokes and the request sent
// at one matched to the provider's call.

import assert from 'node:assert/strict';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { describe, it } from 'node:test';

import { CachedCompletion, CompletionCache } from '../src/cache';
import { ContextCollector, ContextDocument } from '../src/context';
import { AdaptiveDebounce } from '../src/debounce';
import { Definitions, importPositions } from '../src/definitions';
import { EarlyRequest, EarlyRequests, typedCursor } from '../src/keystroke';
import { Liveness } from '../src/liveness';
import { PrivacyFilter, uriPath } from '../src/privacy';
import { codePoints, codePointsBetween } from '../src/protocol';
import { capPrefix, chooseMode, modeAt, nearbyText, nextLineIndent } from '../src/text';
import { DEFAULT_FIRST_DEADLINE_MS, InFlightRequests, requestWaitMs, RequestTimeouts } from '../src/requests';
import { resolveToken } from '../src/token';
import { FinishHow, keptChars, Shown, ShownTracker, TextSource } from '../src/tracker';

describe('chooseMode', () => {
  it('is line mid-line and at the end of a line', () => {
    assert.equal(chooseMode('    x = foo('), 'line');
    assert.equal(chooseMode('    return x'), 'line');
  });
  it('is block on a blank line (the server ends a block at its first unsure line)', () => {
    for (const blank of ['', '    ', '\t']) {
      assert.equal(chooseMode(blank), 'block', JSON.stringify(blank));
    }
  });
  it('is found from a document and an offset', () => {
    const text = 'def f(a):\n    \n    return a\n\nx = 1';
    assert.equal(modeAt(text, text.indexOf('    \n') + 4), 'block');
    assert.equal(modeAt(text, text.indexOf('return')), 'line');
    assert.equal(modeAt(text, text.indexOf('\n\n') + 1), 'block');
    assert.equal(modeAt(text, text.indexOf('x = 1') + 3), 'line');
    assert.equal(modeAt('', 0), 'block');
  });
  it('indents the next line as an editor does on Enter', () => {
    assert.equal(nextLineIndent('    return x', '    '), '    ');
    assert.equal(nextLineIndent('    if x:', '    '), '        ');
    assert.equal(nextLineIndent('\tfoo(', '\t'), '\t\t');
  });
});

describe('bounds', () => {
  it('cuts an over-long prefix in whole steps', () => {
    const a = capPrefix('x'.repeat(460_001));
    const b = capPrefix('x'.repeat(460_002));
    assert.ok(a.length <= 400_000 && b.length <= 400_000);
    assert.equal(b.length - a.length, 1, 'one more keystroke keeps the same start');
    assert.equal(capPrefix('short'), 'short');
  });
  it('takes the lines around a cursor within maxChars', () => {
    const lines = Array.from({ length: 100 }, (_, i) => `line ${i}`);
    const text = nearbyText(lines.length, (i) => lines[i], 50, 40);
    assert.ok(text.length <= 40, text);
    assert.ok(text.includes('line 50'));
    assert.ok(text.includes('line 49') && text.includes('line 51'));
    assert.equal(nearbyText(lines.length, (i) => lines[i], 0, 1000).split('\n').length, 100);
    assert.equal(nearbyText(0, () => '', 0, 10), '');
  });
});

describe('AdaptiveDebounce', () => {
  it('asks at once unless the server says to hold back, within its range', () => {
    const d = new AdaptiveDebounce({ minMs: 0, maxMs: 300 });
    assert.equal(d.delayMs(0), 0, 'nothing known: ask at once');
    d.hold(0, 1000);
    assert.equal(d.delayMs(1100), 0, 'the server says ask at once');
    d.hold(60, 2000);
    assert.equal(d.delayMs(2100), 60, 'the server says it is shared and loaded: its hold');
    assert.equal(d.delayMs(2000 + 3001), 0, 'an old hold is not followed');
    d.hold(900, 6000);
    assert.equal(d.delayMs(6000), 300, 'clamped to max');
    assert.equal(new AdaptiveDebounce({ minMs: 10, maxMs: 100 }).delayMs(0), 10, 'never under the minimum');
    assert.equal(new AdaptiveDebounce({ minMs: 150, maxMs: 150 }).delayMs(0), 150, 'min = max: a fixed wait');
  });
});

describe('typedCursor: which edits are a keystroke at one cursor', () => {
  const edit = (rangeOffset: number, rangeLength: number, text: string) => ({ rangeOffset, rangeLength, text });
  it('an insertion without a line break puts the cursor after it; a deletion within a line where it began', () => {
    assert.equal(typedCursor({ contentChanges: [edit(10, 0, 'x')] }), 11);
    assert.equal(typedCursor({ contentChanges: [edit(10, 0, 'é😀')] }), 13);
    assert.equal(typedCursor({ contentChanges: [edit(9, 1, '')] }), 9);
  });
  it('an auto-closed pair puts the cursor between its two characters', () => {
    assert.equal(typedCursor({ contentChanges: [edit(10, 0, '()')] }), 11);
    assert.equal(typedCursor({ contentChanges: [edit(10, 0, '""')] }), 11);
    assert.equal(typedCursor({ contentChanges: [edit(10, 0, '{}')] }), 11);
    assert.equal(typedCursor({ contentChanges: [edit(10, 0, '(x')] }), 12, 'not a pair');
    assert.equal(typedCursor({ contentChanges: [edit(10, 0, ')(')] }), 12, 'not a pair');
  });
  it('not undo or redo, several changes, a line break, or text typed over a selection', () => {
    assert.equal(typedCursor({ contentChanges: [edit(9, 1, '')], reason: 1 }), undefined);
    assert.equal(typedCursor({ contentChanges: [edit(10, 0, 'x')], reason: 2 }), undefined);
    assert.equal(typedCursor({ contentChanges: [edit(10, 0, 'x'), edit(20, 0, 'x')] }), undefined);
    assert.equal(typedCursor({ contentChanges: [] }), undefined);
    assert.equal(typedCursor({ contentChanges: [edit(10, 0, '\n    ')] }), undefined);
    assert.equal(typedCursor({ contentChanges: [edit(10, 0, 'a\r\nb')] }), undefined);
    assert.equal(typedCursor({ contentChanges: [edit(10, 3, 'x')] }), undefined);
  });
});

describe('EarlyRequests: the request sent at a keystroke, for the provider\'s call', () => {
  const cancelled: string[] = [];
  const request = (id: string, uri: string, version: number, cursor: number): EarlyRequest => ({
    uri, version, cursor, place: { uri, prefix: '', suffix: '' },
    pending: { id, result: new Promise(() => undefined), cancel: () => cancelled.push(id) },
    answer: Promise.resolve(undefined),
  });
  it('is taken once, by a call for the same document, version and cursor', () => {
    const early = new EarlyRequests();
    const a = request('1', 'file:///a.py', 7, 42);
    early.sent(a);
    assert.equal(early.take('file:///a.py', 7, 41), undefined, 'another cursor');
    assert.equal(early.take('file:///a.py', 8, 42), undefined, 'another version');
    assert.equal(early.take('file:///b.py', 7, 42), undefined, 'another document');
    assert.equal(early.take('file:///a.py', 7, 42), a);
    assert.equal(early.take('file:///a.py', 7, 42), undefined, 'taken: the next call asks itself');
    early.typedIn('file:///a.py');
    assert.deepEqual(cancelled, [], 'a taken request is the call\'s, cancelled with it');
  });
  it('one not taken is cancelled, and reported unused, by the next keystroke there or one elsewhere', () => {
    cancelled.length = 0;
    const unused: string[] = [];
    const early = new EarlyRequests((r) => unused.push(r.pending.id));
    early.sent(request('1', 'file:///a.py', 7, 42));
    early.typedIn('file:///b.py');
    assert.deepEqual(cancelled, [], 'an edit in another document leaves it');
    early.typedIn('file:///a.py');
    assert.equal(early.take('file:///a.py', 7, 42), undefined);
    early.sent(request('2', 'file:///a.py', 9, 43));
    early.sent(request('3', 'file:///b.py', 1, 0));
    early.drop();
    assert.deepEqual(cancelled, ['1', '2', '3']);
    assert.deepEqual(unused, ['1', '2', '3']);
  });
});

describe('token', () => {
  it('prefers the setting, then the file', () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'completer-token-'));
    fs.mkdirSync(path.join(dir, 'completer'));
    fs.writeFileSync(path.join(dir, 'completer', 'token'), 'from-file\n');
    assert.equal(resolveToken('', '', { XDG_CONFIG_HOME: dir }), 'from-file');
    assert.equal(resolveToken(' set ', '', { XDG_CONFIG_HOME: dir }), 'set');
    assert.equal(resolveToken('', path.join(dir, 'nope'), { XDG_CONFIG_HOME: dir }), undefined);
  });
});

class Doc implements TextSource {
  constructor(public body: string, public uri = 'file:///a.py') {}
  text(start: number, end: number): string {
    return this.body.slice(Math.max(0, start), Math.max(0, end));
  }
}

const insert = (doc: Doc, at: number, s: string) => {
  doc.body = doc.body.slice(0, at) + s + doc.body.slice(at);
};
const remove = (doc: Doc, at: number, n: number) => {
  doc.body = doc.body.slice(0, at) + doc.body.slice(at + n);
};

describe('counting characters as the server does (code points)', () => {
  it('counts a surrogate pair once, in the range holding its first half', () => {
    const text = 'a😀b🎉';
    assert.equal(text.length, 6);
    assert.equal(codePoints(text), 4);
    assert.equal(codePointsBetween(text, 0, 2), 2, 'a and the emoji it cut into');
    assert.equal(codePointsBetween(text, 2, 6), 2, 'not the emoji again');
    for (let cut = 0; cut <= text.length; cut++) {
      assert.equal(codePointsBetween(text, 0, cut) + codePointsBetween(text, cut, text.length), 4, `cut at ${cut}`);
    }
  });
});

describe('ShownTracker', () => {
  const setup = (alternatives = ['a + b']) => {
    const ended: [Shown, FinishHow][] = [];
    const tracker = new ShownTracker((s, how) => ended.push([s, how]));
    const doc = new Doc('def f():\n    return \n');
    const cursor = doc.body.indexOf('\n', 10);
    tracker.show('7', doc, cursor, alternatives.map((text, index) => ({ index, text })));
    const kept = () => ended.map(([s, how]) => [s.id, keptChars(s).accepted, keptChars(s).typed, how]);
    return { ended, kept, tracker, doc, cursor };
  };

  it('type-through keeps the rest, typed chars are counted apart from accepted ones', () => {
    const { kept, tracker, doc, cursor } = setup();
    insert(doc, cursor, 'a ');
    assert.deepEqual(tracker.observe(doc, cursor + 2, 'typed'), [{ index: 0, text: '+ b' }]);
    insert(doc, cursor + 2, '+ b');
    assert.equal(tracker.observe(doc, cursor + 5, 'typed'), undefined);
    assert.deepEqual(kept(), [['7', 0, 5, 'typed']]);
  });
  it('partial then whole accept credits every char', () => {
    const { kept, tracker, doc, cursor } = setup();
    insert(doc, cursor, 'a');
    assert.deepEqual(tracker.observe(doc, cursor + 1, 'accepted'), [{ index: 0, text: ' + b' }]);
    insert(doc, cursor + 1, ' + b');
    tracker.acceptedWhole('7', 0, doc, cursor + 5);
    assert.deepEqual(kept(), [['7', 5, 0, 'accepted']]);
  });
  it('counts code points: an emoji accepted is one character, not two UTF-16 units', () => {
    const { kept, tracker, doc, cursor } = setup(['😀😀 = "🎉"']);
    insert(doc, cursor, '😀😀');
    assert.deepEqual(tracker.observe(doc, cursor + 4, 'accepted'), [{ index: 0, text: ' = "🎉"' }]);
    insert(doc, cursor + 4, ' ');
    tracker.observe(doc, cursor + 5, 'typed');
    tracker.finish('dismissed');
    assert.deepEqual(kept(), [['7', 2, 1, 'dismissed']]);
  });
  it('backspace takes back what it deletes', () => {
    const { kept, tracker, doc, cursor } = setup();
    insert(doc, cursor, 'a +');
    tracker.observe(doc, cursor + 3, 'accepted');
    remove(doc, cursor + 2, 1);
    assert.deepEqual(tracker.observe(doc, cursor + 2, 'typed'), [{ index: 0, text: '+ b' }]);
    tracker.finish('dismissed');
    assert.deepEqual(kept(), [['7', 2, 0, 'dismissed']]);
  });
  it('alternatives: typing keeps those that agree; accepting one credits it', () => {
    const { ended, tracker, doc, cursor } = setup(['a + b', 'a - b', 'x']);
    insert(doc, cursor, 'a ');
    assert.deepEqual(tracker.observe(doc, cursor + 2, 'typed'), [{ index: 0, text: '+ b' }, { index: 1, text: '- b' }]);
    insert(doc, cursor + 2, '- b');
    tracker.acceptedWhole('7', 1, doc, cursor + 5);
    assert.deepEqual(ended.map(([s, how]) => [s.alive[0].index, keptChars(s), how]), [[1, { accepted: 3, typed: 2 }, 'accepted']]);
  });
  it('a different char, another document or a new suggestion ends it as dismissed', () => {
    const { ended, tracker, doc, cursor } = setup();
    insert(doc, cursor, 'x');
    assert.equal(tracker.observe(doc, cursor + 1, 'typed'), undefined);
    tracker.show('8', doc, cursor + 1, [{ index: 0, text: 'yz' }]);
    assert.equal(tracker.observe(new Doc(doc.body, 'file:///b.py'), cursor + 1, 'typed'), undefined);
    tracker.show('9', doc, cursor + 1, [{ index: 0, text: 'yz' }]);
    tracker.show('10', doc, cursor + 1, [{ index: 0, text: 'yz' }]);
    assert.deepEqual(ended.map(([s, how]) => [s.id, keptChars(s).accepted, how]),
      [['7', 0, 'dismissed'], ['8', 0, 'dismissed'], ['9', 0, 'replaced']]);
  });
});

describe('CompletionCache', () => {
  const place = (prefix: string, suffix = '\n', uri = 'file:///a.py') => ({ uri, prefix, suffix });
  const one = (id: string, text: string): CachedCompletion => ({ id, alternatives: [{ index: 0, text }] });

  it('serves a place seen before, and one typed ahead on the same line', () => {
    const cache = new CompletionCache(8);
    cache.put(place('x = 1\nreturn '), one('1', 'a + b'));
    assert.deepEqual(cache.get(place('x = 1\nreturn ')), { id: '1', alternatives: [{ index: 0, text: 'a + b' }], typed: '' });
    assert.deepEqual(cache.get(place('x = 1\nreturn a +')), { id: '1', alternatives: [{ index: 0, text: ' b' }], typed: 'a +' });
    assert.equal(cache.get(place('x = 1\nreturn a -')), undefined, 'typed what the completion does not say');
    assert.equal(cache.get(place('x = 1\nreturn a + b')), undefined, 'nothing left to insert');
    assert.equal(cache.get(place('x = 2\nreturn ')), undefined, 'another line above');
    assert.equal(cache.get(place('x = 1\nreturn ', ' # after\n')), undefined, 'another suffix');
    assert.equal(cache.get(place('x = 1\nreturn ', '\n', 'file:///b.py')), undefined, 'another document');
  });
  it('drops the least recently used, and says so', () => {
    const dropped: string[] = [];
    const cache = new CompletionCache(2, (e) => dropped.push(e.id));
    cache.put(place('a'), one('1', 'x'));
    cache.put(place('b'), one('2', 'x'));
    assert.ok(cache.get(place('a')));
    cache.put(place('c'), one('3', 'x'));
    assert.deepEqual(dropped, ['2']);
    assert.equal(cache.get(place('b')), undefined);
    assert.equal(new CompletionCache(0).put(place('a'), one('4', 'x')), false, 'size 0: off');
  });
});

describe('privacy', () => {
  const filter = (over: Partial<{ languages: Record<string, boolean>; exclude: string[]; excludeSensitiveFiles: boolean }> = {}) =>
    new PrivacyFilter({ languages: { '*': true, plaintext: false }, exclude: [], excludeSensitiveFiles: true, ...over });

  it('excludes files that hold secrets by default', () => {
    const f = filter();
    for (const path of ['/p/.env', '/p/.env.local', '/p/prod.env', '/p/server.pem', '/p/tls/server.KEY', '/h/.ssh/id_rsa',
      '/h/id_ed25519.pub', '/h/.aws/config', '/p/.npmrc', '/p/.git-credentials', '/p/credentials.json', '/p/secrets.yaml',
      '/p/terraform.tfvars', '/h/.kube/config', '/p/my%20keys/a.pem']) {
      assert.ok(f.excludedPath(`file://${path}`), path);
    }
    for (const path of ['/p/app.py', '/p/env.py', '/p/keyboard.ts', '/p/environment.md', '/p/.envelope.js', '/p/key.py']) {
      assert.ok(!f.excludedPath(`file://${path}`), path);
    }
    assert.ok(!filter({ excludeSensitiveFiles: false }).excludedPath('file:///p/.env'));
  });
  it('adds the user globs and turns languages off', () => {
    const f = filter({ exclude: ['**/private/**', '*.gen.py'], languages: { '*': true, markdown: false } });
    assert.ok(f.excludedPath('file:///p/private/a.py'));
    assert.ok(f.excludedPath('file:///p/src/x.gen.py'));
    assert.ok(!f.excludedPath('file:///p/src/x.py'));
    assert.ok(!f.allows('file:///p/README.md', 'markdown'));
    assert.ok(f.allows('file:///p/a.py', 'python'));
    assert.ok(!filter().allows('file:///p/notes.txt', 'plaintext'));
    assert.equal(uriPath('vscode-remote://ssh-remote%2Bhost/home/a/.env'), '/home/a/.env');
  });
});

describe('ContextCollector', () => {
  const doc = (uri: string, lines: string[], languageId = 'python'): ContextDocument =>
    ({ uri, languageId, lineCount: lines.length, lineAt: (i) => lines[i] });
  const lines = (name: string, n: number) => Array.from({ length: n }, (_, i) => `${name}_${i} = ${i}`);

  it('edited regions first, then documents used lately; same language; stable while typing in one place', () => {
    const collector = new ContextCollector(() => ({ enabled: true, maxSnippets: 4, maxChars: 60 }),
      (uri) => !uri.endsWith('.env'));
    const a = lines('a', 100);
    const docA = doc('file:///a.py', a);
    const docB = doc('file:///b.py', lines('b', 100));
    const js = doc('file:///c.js', lines('c', 10), 'javascript');
    const env = doc('file:///.env', ['KEY=secret']);
    [docB, js, env].forEach((d) => collector.seen(d, 0));
    collector.changed(docA, 50);
    a[50] = 'a_50 = 5000';
    collector.left(docA, 50);
    const main = doc('file:///main.py', lines('m', 10));
    const first = collector.forRequest(main.uri, 'python', 3);
    assert.deepEqual(first.map((c) => [c.uri, c.kind]), [['file:///a.py', 'edit'], ['file:///b.py', 'open']]);
    assert.ok(first[0].text.includes('a_50 = 5000') && first[0].text.length <= 60, first[0].text);
    for (let line = 3; line < 6; line++) { // typing in main.py, even over several lines
      collector.changed(main, line);
      a[51] = `changed later ${line}`; // a's live text moves on: the snapshot does not
      assert.deepEqual(collector.forRequest(main.uri, 'python', line), first);
    }
  });
});

describe('Definitions', () => {
  it('finds the names imports bind, aliases and parenthesized lists included', () => {
    const text = 'import os.path\nfrom .models import Invoice as Inv, Line  # x\nfrom a import (\n    b,\n    c)\nx = 1\n';
    assert.deepEqual(importPositions(text), [
      { line: 0, character: 10 }, { line: 1, character: 20 }, { line: 1, character: 36 },
      { line: 3, character: 4 }, { line: 4, character: 4 }]);
  });

  it('looks up in the background, once per set of imports; never reads an excluded file', async () => {
    const asked: string[] = [];
    const read: string[] = [];
    const defs = new Definitions({
      lookup: (_uri, line) => {
        asked.push(String(line));
        return Promise.resolve(line === 0 ? [{ uri: 'file:///p/shapes.py', line: 3 }] : [{ uri: 'file:///p/.env', line: 0 }]);
      },
      read: (uri, line) => {
        read.push(uri);
        return Promise.resolve({ text: `def area(r):  # ${uri}:${line}`, languageId: 'python' });
      },
    }, () => ({ max: 8, maxChars: 100 }), (uri) => !uri.endsWith('.env'));
    const doc = { uri: 'file:///p/main.py', languageId: 'python', text: 'from shapes import area\nfrom env import KEY\n' };
    assert.deepEqual(defs.forRequest(doc.uri), []); // nothing yet, and nothing waited for
    await defs.refresh(doc);
    assert.deepEqual(defs.forRequest(doc.uri), [{ uri: 'file:///p/shapes.py', text: 'def area(r):  # file:///p/shapes.py:3', kind: 'definition' }]);
    assert.deepEqual(read, ['file:///p/shapes.py'], 'the .env file is never opened');
    await defs.refresh({ ...doc, text: doc.text + 'x = 1\n' }); // imports unchanged: no lookup
    assert.equal(asked.length, 2);
    await defs.refresh({ ...doc, languageId: 'javascript' });
    assert.equal(asked.length, 2, 'Python only');
  });
});

describe('Liveness', () => {
  it('probes after the silence, and a resumed machine at once; an unanswered probe is death', async () => {
    let now = 0;
    const pings: number[] = [];
    let dead = '';
    const liveness = new Liveness({ silenceMs: 1000, pongTimeoutMs: 400, ping: () => pings.push(now), dead: (d) => (dead = d), now: () => now });
    const tick = () => new Promise((r) => setTimeout(r, 120)); // the check runs every 100 ms here
    now = 900;
    await tick();
    assert.deepEqual(pings, [], 'not silent long enough');
    now = 60_000; // the machine slept a minute
    await tick();
    assert.deepEqual(pings, [60_000], 'the first check after the resume probes');
    liveness.heard(); // the pong
    now = 60_500;
    await tick();
    assert.equal(dead, '');
    now = 61_600;
    await tick();
    assert.deepEqual(pings, [60_000, 61_600]);
    now = 62_100;
    await tick();
    assert.match(dead, /no answer from the server/);
    liveness.stop();
  });
});

describe('request timeouts', () => {
  const params = (deadline?: number) => ({
    document: { uri: 'file:///p/a.py', language: 'python', prefix: 'x = ', suffix: '' },
    ...(deadline === undefined ? {} : { deadline_ms: deadline }),
  });
  const timedOutAfter = async (timeouts: RequestTimeouts, deadline?: number): Promise<number> => {
    const requests = new InFlightRequests(() => undefined, () => undefined, () => undefined, timeouts);
    const started = performance.now();
    const result = await requests.add(params(deadline), {}).result;
    assert.equal(result.reason, 'timeout');
    return performance.now() - started;
  };
  it("follows the server's default deadline when the request names none", async () => {
    // (A document's first request on the connection: the first deadline, the same here; below, they differ.)
    const waited = await timedOutAfter({ assumedDeadlineMs: 10_000, requestMarginMs: 20, serverDeadlineMs: 30, serverFirstDeadlineMs: 30 });
    assert.ok(waited >= 45 && waited < 2_000, `gave up after ${waited} ms`);
  });
  it("a request's own deadline_ms wins over the server's", async () => {
    const waited = await timedOutAfter({ assumedDeadlineMs: 10_000, requestMarginMs: 20, serverDeadlineMs: 5_000 }, 30);
    assert.ok(waited >= 45 && waited < 2_000, `gave up after ${waited} ms`);
  });
  it('assumes a deadline when the server says none', async () => {
    const waited = await timedOutAfter({ assumedDeadlineMs: 40, requestMarginMs: 20 });
    assert.ok(waited >= 55 && waited < 2_000, `gave up after ${waited} ms`);
  });
});

describe('the wait for a request (deadline plus margin, or the user\'s override)', () => {
  const t = (over: Partial<RequestTimeouts> = {}): RequestTimeouts =>
    ({ assumedDeadlineMs: 10_000, requestMarginMs: 2_000, serverDeadlineMs: 2_000, serverFirstDeadlineMs: 15_000, ...over });
  it("follows the server's deadlines: longer for a document's first request, which prefills it cold", () => {
    assert.equal(requestWaitMs(t(), undefined, false), 4_000);
    assert.equal(requestWaitMs(t(), undefined, true), 17_000);
    assert.equal(requestWaitMs(t({ serverFirstDeadlineMs: 30_000 }), undefined, true), 32_000);
    assert.equal(requestWaitMs(t({ serverFirstDeadlineMs: undefined }), undefined, true), DEFAULT_FIRST_DEADLINE_MS + 2_000,
      'a server that says its deadline but not the first one: its default');
    assert.equal(requestWaitMs(t({ serverDeadlineMs: undefined, serverFirstDeadlineMs: undefined }), undefined, true), 12_000,
      'a server too old to say: assumed');
  });
  it("a request's own deadline_ms, first or not; the user's override wins over everything", () => {
    assert.equal(requestWaitMs(t(), 500, true), 2_500);
    assert.equal(requestWaitMs(t(), 500, false), 2_500);
    assert.equal(requestWaitMs(t({ overrideMs: 700 }), 500, true), 700);
    assert.equal(requestWaitMs(t({ overrideMs: 700 }), undefined, false), 700);
    assert.equal(requestWaitMs(t({ overrideMs: 0 }), undefined, false), 4_000, '0: no override');
  });
  it("times a document's first request on the connection by the first deadline, the next ones by the other", async () => {
    const ends: string[] = [];
    const requests = new InFlightRequests(() => undefined, (r) => ends.push(`${r.id}:${r.reason}`), () => undefined,
      t({ serverDeadlineMs: 20, serverFirstDeadlineMs: 400, requestMarginMs: 20 }));
    const doc = (uri: string) => ({ document: { uri, language: 'python', prefix: 'x = ', suffix: '' } });
    const started = performance.now();
    const first = requests.add(doc('file:///p/a.py'), {});
    const second = requests.add({ ...doc('file:///p/a.py'), supersede: false }, {});
    const secondEnd = await second.result;
    assert.equal(secondEnd.reason, 'timeout');
    assert.ok(performance.now() - started < 300, 'the second request: the short deadline');
    assert.equal((await first.result).reason, 'timeout');
    assert.ok(performance.now() - started >= 415, `the first: the first deadline (${performance.now() - started} ms)`);
    requests.failAll('closed'); // a new connection: its server has seen no document
    const again = performance.now();
    assert.equal((await requests.add(doc('file:///p/a.py'), {}).result).reason, 'timeout');
    assert.ok(performance.now() - again >= 415, 'first again on the next connection');
  });
});

describe('requests generating a suggestion (the status bar\'s spinner)', () => {
  const doc = (uri = 'file:///p/a.py') => ({ document: { uri, language: 'python', prefix: 'x = ', suffix: '' } });
  const setup = (timeouts: Partial<RequestTimeouts> = {}) => {
    const seen: number[] = [];
    const sent: Record<string, unknown>[] = [];
    const requests: InFlightRequests = new InFlightRequests((m) => sent.push(m), () => undefined, () => undefined,
      { assumedDeadlineMs: 10_000, requestMarginMs: 2_000, ...timeouts }, () => seen.push(requests.generating));
    return { requests, seen, sent };
  };
  it('counts completions in flight, not primes nor prefetches; each end, cancel or supersession takes one off', () => {
    const { requests, seen } = setup();
    const a = requests.add(doc(), {});
    requests.add({ ...doc(), max_tokens: 0, supersede: false }, { purpose: 'prime' });
    requests.add({ ...doc('file:///p/b.py'), supersede: false }, { purpose: 'speculative' });
    assert.equal(requests.generating, 1);
    requests.add(doc(), {}); // supersedes `a` on the server: nobody waits for `a` any more
    assert.equal(requests.generating, 1);
    assert.deepEqual(seen, [1, 1, 1, 1]);
    requests.onFrame({ type: 'done', id: a.id, reason: 'cancelled', text: '' });
    const c = requests.add(doc('file:///p/c.py'), {});
    assert.equal(requests.generating, 2);
    c.cancel(); // the user moved on: off at once, before the server's `done`
    assert.equal(requests.generating, 1);
    requests.onFrame({ type: 'error', id: '4', code: 'internal', message: 'x' }); // the second completion ends in an error
    assert.equal(requests.generating, 0);
    assert.deepEqual(seen.slice(-3), [2, 1, 0]);
    requests.add(doc('file:///p/d.py'), {});
    requests.failAll('gone'); // disconnected
    assert.equal(requests.generating, 0);
    assert.equal(seen.at(-1), 0);
  });
  it('a request that times out stops generating', async () => {
    const { requests, seen, sent } = setup({ overrideMs: 30 });
    const r = requests.add(doc(), {});
    assert.equal(requests.generating, 1);
    assert.equal((await r.result).reason, 'timeout');
    assert.equal(requests.generating, 0);
    assert.equal(seen.at(-1), 0);
    assert.deepEqual(sent.at(-1), { type: 'cancel', id: r.id }, 'and the server is told');
  });
});
