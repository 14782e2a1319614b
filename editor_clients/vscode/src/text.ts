// Pure text helpers of the provider (no vscode API): the request's mode, the
// bounds on what is sent, the nearby text of other editors, the next line's
// indentation.

import type { DocumentState, Mode } from './protocol';

/**
 * `block` on a blank line (after a line that opens a block, or in a body: a
 * new statement may follow, and the server ends the block before its first
 * line the model is unsure of); `line` everywhere else (code after the cursor
 * is the rest of a statement). The Neovim plugin's `auto` rule.
 */
export function chooseMode(currentLine: string): Mode {
  return currentLine.trim() === '' ? 'block' : 'line';
}

/** `chooseMode` at offset `cursor` of `text`. */
export function modeAt(text: string, cursor: number): Mode {
  const lineStart = text.lastIndexOf('\n', cursor - 1) + 1;
  const lineEnd = text.indexOf('\n', cursor);
  return chooseMode(text.slice(lineStart, lineEnd < 0 ? text.length : lineEnd));
}

/** The `document` of a request at offset `cursor` of `text`. */
export function documentAt(uri: string, language: string, text: string, cursor: number): DocumentState {
  return { uri, language, prefix: capPrefix(text.slice(0, cursor)), suffix: capSuffix(text.slice(cursor)) };
}

const BLOCK_OPENER = /[:{([]$/;

/**
 * The indentation an editor gives the line after `line` on Enter: the same,
 * one `unit` more after a block opener.
 */
export function nextLineIndent(line: string, unit: string): string {
  const indent = /^\s*/.exec(line)?.[0] ?? '';
  return BLOCK_OPENER.test(line.trimEnd()) ? indent + unit : indent;
}

/** Bounds on what one request carries (the server fits the prompt itself; these only cap the frame). */
export const MAX_PREFIX_CHARS = 400_000;
export const MAX_SUFFIX_CHARS = 100_000;
const STEP = 50_000;

/**
 * An over-long prefix cut at its start, in whole steps of the document (not
 * per keystroke), so consecutive requests keep a common start and the
 * server's warm KV cache stays valid.
 */
export function capPrefix(prefix: string, max = MAX_PREFIX_CHARS): string {
  if (prefix.length <= max) {
    return prefix;
  }
  const start = Math.ceil((prefix.length - max) / STEP) * STEP;
  return prefix.slice(start);
}

export function capSuffix(suffix: string, max = MAX_SUFFIX_CHARS): string {
  return suffix.length <= max ? suffix : suffix.slice(0, max);
}

/**
 * The lines around `line` (0-based) of a document of `lineCount` lines read
 * through `lineAt`, widened one line at a time on alternate sides while they
 * fit in `maxChars`. Empty when nothing fits.
 */
export function nearbyText(lineCount: number, lineAt: (i: number) => string, line: number, maxChars: number): string {
  if (lineCount <= 0 || maxChars <= 0) {
    return '';
  }
  const center = Math.min(Math.max(0, line), lineCount - 1);
  const lines = [lineAt(center)];
  let lo = center;
  let hi = center; // inclusive
  let size = lines[0].length + 1;
  if (size > maxChars) {
    return lines[0].slice(0, maxChars);
  }
  const fits = { up: true, down: true };
  while (fits.up || fits.down) {
    if (fits.up) {
      const text = lo > 0 ? lineAt(lo - 1) : undefined;
      if (text === undefined || size + text.length + 1 > maxChars) {
        fits.up = false;
      } else {
        lines.unshift(text);
        lo -= 1;
        size += text.length + 1;
      }
    }
    if (fits.down) {
      const text = hi < lineCount - 1 ? lineAt(hi + 1) : undefined;
      if (text === undefined || size + text.length + 1 > maxChars) {
        fits.down = false;
      } else {
        lines.push(text);
        hi += 1;
        size += text.length + 1;
      }
    }
  }
  return lines.join('\n');
}
