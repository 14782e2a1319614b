// A document as the provider and its helpers see it: its text and version
// (DocumentText), ranges of it (TextSource), the document as if the suggest
// widget's selected item were inserted, and waits that end with a
// cancellation token.

import * as vscode from 'vscode';

import type { DocumentText } from './prefetch';
import type { TextSource } from './tracker';

export function textSource(doc: vscode.TextDocument): TextSource {
  return {
    uri: doc.uri.toString(),
    text: (start, end) => (end <= start ? '' : doc.getText(new vscode.Range(doc.positionAt(Math.max(0, start)), doc.positionAt(end)))),
  };
}

export function documentText(doc: vscode.TextDocument): DocumentText {
  return { uri: doc.uri.toString(), languageId: doc.languageId, version: doc.version, text: doc.getText() };
}

/** Resolves true after `ms`, false as soon as `token` is cancelled. */
export function sleep(ms: number, token: vscode.CancellationToken): Promise<boolean> {
  if (token.isCancellationRequested) {
    return Promise.resolve(false);
  }
  if (ms <= 0) {
    return Promise.resolve(true);
  }
  return new Promise((resolve) => {
    const timer = setTimeout(() => {
      sub.dispose();
      resolve(true);
    }, ms);
    const sub = token.onCancellationRequested(() => {
      clearTimeout(timer);
      sub.dispose();
      resolve(false);
    });
  });
}

/** `promise`'s value, or undefined as soon as `token` is cancelled. */
export function unlessCancelled<T>(promise: Promise<T>, token: vscode.CancellationToken): Promise<T | undefined> {
  return new Promise((resolve) => {
    const sub = token.onCancellationRequested(() => resolve(undefined));
    void promise.then((v) => {
      sub.dispose();
      resolve(v);
    });
  });
}

/**
 * The document as if the suggest widget's selected item were inserted: its
 * text replacing its range, the cursor after it. What the provider asks for
 * and caches there; what it offers is the item's text and the completion,
 * over the item's range.
 */
export interface AsIfSelected {
  range: vscode.Range;
  /** The selected item's text (what it inserts). */
  head: string;
  doc: DocumentText;
  cursor: number;
  source: TextSource;
}

export function asIfSelected(document: vscode.TextDocument, position: vscode.Position,
  selected: vscode.SelectedCompletionInfo): AsIfSelected | undefined {
  const doc = documentText(document);
  const start = document.offsetAt(selected.range.start);
  const end = document.offsetAt(selected.range.end);
  if (end < document.offsetAt(position) || start > end) {
    return undefined; // an item that would leave the cursor where it is not: nothing to extend
  }
  const text = doc.text.slice(0, start) + selected.text + doc.text.slice(end);
  return {
    range: selected.range, head: selected.text, doc: { ...doc, text }, cursor: start + selected.text.length,
    source: { uri: doc.uri, text: (a, b) => (b <= a ? '' : text.slice(Math.max(0, a), b)) },
  };
}

/** The 0-based line of offset `cursor`. */
export function lineOf(text: string, cursor: number): number {
  let line = 0;
  for (let i = text.indexOf('\n'); i >= 0 && i < cursor; i = text.indexOf('\n', i + 1)) {
    line += 1;
  }
  return line;
}
