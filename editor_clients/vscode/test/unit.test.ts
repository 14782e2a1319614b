// The pure parts: mode choice, bounds, nearby text, debounce, the shown-suggestion tracker.

import assert from 'node:assert/strict';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { describe, it } from 'node:test';

import { AdaptiveDebounce } from '../src/debounce';
import { capPrefix, chooseMode, nearbyText } from '../src/text';
import { resolveToken } from '../src/token';
import { FinishHow, Shown, ShownTracker, TextSource } from '../src/tracker';

describe('chooseMode', () => {
  it('is line mid-line and at the end of a line', () => {
    assert.equal(chooseMode('    x = foo(', 'def f():'), 'line');
    assert.equal(chooseMode('    return x', 'def f():'), 'line');
  });
  it('is block at an empty line right after a block opener', () => {
    for (const opener of ['def f(a):', 'if (x) {', 'call(', 'xs = [', 'class A:  ']) {
      assert.equal(chooseMode('    ', opener), 'block', opener);
      assert.equal(chooseMode('', opener), 'block', opener);
    }
  });
  it('is line at an empty line after anything else', () => {
    assert.equal(chooseMode('', 'x = 1'), 'line');
    assert.equal(chooseMode('', undefined), 'line');
    assert.equal(chooseMode('', ''), 'line');
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
  it('stays in its range and follows the typing rhythm and latency', () => {
    const d = new AdaptiveDebounce({ minMs: 20, maxMs: 400 });
    assert.equal(d.delayMs(), 210, 'no rhythm yet: the middle of the range');
    let t = 0;
    for (let i = 0; i < 20; i++) {
      d.keystroke((t += 100));
    }
    const typing = d.delayMs();
    assert.ok(Math.abs(typing - 150) <= 1, `about 1.5 gaps: ${typing}`);
    for (let i = 0; i < 20; i++) {
      d.keystroke((t += 30));
    }
    assert.ok(d.delayMs() < typing, 'faster typing waits less');
    for (let i = 0; i < 20; i++) {
      d.latency(60);
    }
    assert.equal(d.delayMs(), 20, 'slow server: clamped to min');
    d.keystroke((t += 5000)); // a pause is not rhythm
    for (let i = 0; i < 30; i++) {
      d.keystroke((t += 900));
    }
    assert.equal(d.delayMs(), 400, 'clamped to max');
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

describe('ShownTracker', () => {
  const setup = () => {
    const ended: [Shown, FinishHow][] = [];
    const tracker = new ShownTracker((s, how) => ended.push([s, how]));
    const doc = new Doc('def f():\n    return \n');
    const cursor = doc.body.indexOf('\n', 10);
    tracker.show('7', doc, cursor, 'a + b');
    return { ended, tracker, doc, cursor };
  };
  const insert = (doc: Doc, at: number, s: string) => {
    doc.body = doc.body.slice(0, at) + s + doc.body.slice(at);
  };

  it('type-through keeps the rest, typed chars are not accepted', () => {
    const { ended, tracker, doc, cursor } = setup();
    insert(doc, cursor, 'a ');
    assert.equal(tracker.observe(doc, cursor + 2, 'typed'), '+ b');
    insert(doc, cursor + 2, '+ b');
    assert.equal(tracker.observe(doc, cursor + 5, 'typed'), undefined);
    assert.deepEqual(ended.map(([s, how]) => [s.accepted, s.typed, how]), [[0, 5, 'typed']]);
  });
  it('partial then whole accept credits every char', () => {
    const { ended, tracker, doc, cursor } = setup();
    insert(doc, cursor, 'a');
    assert.equal(tracker.observe(doc, cursor + 1, 'accepted'), ' + b');
    insert(doc, cursor + 1, ' + b');
    tracker.acceptedWhole('7', doc, cursor + 5);
    assert.deepEqual(ended.map(([s, how]) => [s.id, s.accepted, how]), [['7', 5, 'accepted']]);
  });
  it('a different char, another document or a new suggestion ends it as dismissed', () => {
    const { ended, tracker, doc, cursor } = setup();
    insert(doc, cursor, 'x');
    assert.equal(tracker.observe(doc, cursor + 1, 'typed'), undefined);
    tracker.show('8', doc, cursor + 1, 'yz');
    assert.equal(tracker.observe(new Doc(doc.body, 'file:///b.py'), cursor + 1, 'typed'), undefined);
    tracker.show('9', doc, cursor + 1, 'yz');
    tracker.show('10', doc, cursor + 1, 'yz');
    assert.deepEqual(ended.map(([s, how]) => [s.id, s.accepted, how]),
      [['7', 0, 'dismissed'], ['8', 0, 'dismissed'], ['9', 0, 'replaced']]);
  });
});
