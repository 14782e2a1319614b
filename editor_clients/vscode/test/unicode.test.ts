// Characters beyond the Basic Multilingual Plane (emoji): VS Code measures
// text in UTF-16 code units, two per such character, while the server counts
// code points (Python's `len`). The feedback must count as the server does.
// The small packaged model never writes an emoji; SmolLM2-135M copies them.

import './vscode-hook';

import assert from 'node:assert/strict';
import { after, afterEach, before, describe, it } from 'node:test';

import { fake, nextWord } from './fake-vscode';
import { Server } from './server';
import { chars, closeSession, counters, countersMatch, feedbackFor, start, suggestion } from './session';

const TOKEN = 'vscode-unicode-test-token';
let server: Server;

// Lines the model copies, emoji first.
const EMOJI_PROMPTS = [
  'x = "😀😀 smile"\ny = "😀😀 smile"\nz = "|\n',
  'print("🚀🚀 launch")\nprint("🚀🚀 launch")\nprint("|\n',
  '# 🎉🎉 done\n# 🎉🎉 done\n# |\n',
];
const ASTRAL = /[\u{10000}-\u{10FFFF}]/u;

before(async () => {
  server = await Server.start(TOKEN, 0, 300_000, 'default');
});

after(async () => {
  await server?.stop();
});

afterEach(() => closeSession());

describe('characters beyond the BMP', () => {
  it('typed through and accepted emoji are counted as the server counts them: one each', async () => {
    const s = await start(server, { 'completer.token': TOKEN });
    const before = await counters(server);
    const shown = await suggestion(s, (t) => [...nextWord(t)].length >= 2 && ASTRAL.test(nextWord(t)), 'emoji', EMOJI_PROMPTS);
    const word = nextWord(shown.text);
    const first = [...word][0];
    assert.equal(first.length, 2, `${first}: two UTF-16 units`);

    await Promise.all(fake.type(first)); // typed through: one character
    await fake.commandsRun('completer.acceptNextWord'); // the rest of the word
    await fake.commandsRun('completer.dismiss');
    assert.deepEqual(feedbackFor(s, shown.id), [{
      type: 'feedback', id: shown.id, accepted_chars: chars(word) - 1, typed_chars: 1, shown: true,
    }]);
    assert.ok(chars(word) - 1 < word.length - first.length, 'the UTF-16 count would be larger');
    await countersMatch(server, s, before);
  });
});
