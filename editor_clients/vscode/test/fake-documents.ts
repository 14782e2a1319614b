// Documents and editors of the fake `vscode` module, and VS Code's rules for
// how much of a suggestion "next word" and "next line" accept.

import { EventEmitter, Position, Range, Selection, Uri } from './fake-basics';

export interface DocumentChange {
  document: FakeDocument;
  contentChanges: { range: Range; rangeOffset: number; rangeLength: number; text: string }[];
}

export class FakeDocument {
  /** Every edit of every document (the workbench passes them on to workspace.onDidChangeTextDocument). */
  static readonly edited = new EventEmitter<DocumentChange>();
  version = 1;
  readonly uri: Uri;
  constructor(uri: string, readonly languageId: string, private text: string) {
    this.uri = Uri.parse(uri);
  }
  get lineCount(): number {
    return this.text.split('\n').length;
  }
  getText(range?: Range): string {
    if (!range) {
      return this.text;
    }
    return this.text.slice(this.offsetAt(range.start), this.offsetAt(range.end));
  }
  lineAt(line: number): { text: string } {
    return { text: this.text.split('\n')[line] ?? '' };
  }
  offsetAt(p: Position): number {
    const lines = this.text.split('\n');
    let offset = 0;
    for (let i = 0; i < Math.min(p.line, lines.length); i++) {
      offset += lines[i].length + 1;
    }
    return Math.min(this.text.length, offset + Math.min(p.character, (lines[p.line] ?? '').length));
  }
  positionAt(offset: number): Position {
    const before = this.text.slice(0, Math.max(0, Math.min(offset, this.text.length)));
    const lines = before.split('\n');
    return new Position(lines.length - 1, lines[lines.length - 1].length);
  }
  /** Replace [start, end) with `text`; listeners of workspace.onDidChangeTextDocument hear of it. */
  edit(start: number, end: number, text: string): void {
    const range = new Range(this.positionAt(start), this.positionAt(end));
    this.text = this.text.slice(0, start) + text + this.text.slice(end);
    this.version += 1;
    FakeDocument.edited.fire({ document: this, contentChanges: [{ range, rangeOffset: start, rangeLength: end - start, text }] });
  }
}

export class FakeEditor {
  selections: Selection[];
  options: { tabSize?: number; insertSpaces?: boolean } = { tabSize: 4, insertSpaces: true };
  constructor(readonly document: FakeDocument, cursor: number) {
    const p = document.positionAt(cursor);
    this.selections = [new Selection(p, p)];
  }
  get selection(): Selection {
    return this.selections[0];
  }
  set selection(s: Selection) {
    this.selections = [s];
  }
  get cursor(): number {
    return this.document.offsetAt(this.selection.active);
  }
}

/** VS Code's next-word rule, roughly: leading spaces, then a word or a run of punctuation. */
export function nextWord(s: string): string {
  const m = /^\s*(\w+|[^\w\s]+)|^\s+/.exec(s);
  return m ? m[0] : s;
}

/** The next line: up to the first line break (the break itself when the line is empty). */
export function nextLine(s: string): string {
  const nl = s.indexOf('\n');
  if (nl < 0) {
    return s;
  }
  return nl === 0 ? '\n' : s.slice(0, nl);
}
