// The definitions of the names a Python document imports, found by the
// editor's language server (extension.ts asks `vscode.executeDefinitionProvider`)
// and sent as context of kind "definition".
//
// Never on a keystroke's path: refresh() runs in the background when a
// document becomes active or its import lines change (editors.ts), looks up
// only when those lines differ from the last lookup's, and leaves its answers
// in a cache that the next request reads (forRequest). A definition in a file
// the privacy rules exclude is never read. No vscode API.

import type { ContextItem } from './protocol';

export interface DefinitionHost {
  /** The definitions of the name at (line, character) of `uri`: their files' URIs and first lines. */
  lookup(uri: string, line: number, character: number): Promise<{ uri: string; line: number }[]>;
  /** `lines` lines of `uri` from `line` on, with its language, or undefined when it cannot be read. */
  read(uri: string, line: number, lines: number): Promise<{ text: string; languageId: string } | undefined>;
}

export interface DefinitionLimits {
  /** How many imported names are looked up (0: none). */
  max: number;
  maxChars: number;
}

/** Imports sit at the top: a long file is not scanned whole. */
const SCAN_LINES = 300;
const SNIPPET_LINES = 32;
const NAME = /[A-Za-z_][\w.]*/g;

/** Where the names bound by a Python file's imports are: `from a import b as c` gives b, `import a.b` gives b. */
export function importPositions(text: string): { line: number; character: number }[] {
  const out: { line: number; character: number }[] = [];
  const lines = text.split('\n', SCAN_LINES);
  let open = false; // inside `from x import ( ... )`
  lines.forEach((raw, row) => {
    const line = raw.replace(/#.*/, '');
    let start = -1;
    if (open) {
      start = 0;
      open = !line.includes(')');
    } else {
      const from = /^\s*from\s+[\w.]+\s+import\s+/.exec(line) ?? /^\s*import\s+/.exec(line);
      if (!from) {
        return;
      }
      start = from[0].length;
      open = line.includes('(', start) && !line.includes(')', start);
    }
    for (const m of line.slice(start).matchAll(NAME)) {
      const at = start + (m.index ?? 0);
      if (m[0] === 'as' || m[0] === 'import' || /\bas\s+$/.test(line.slice(0, at))) {
        continue; // the alias is ours; the name it renames is what has a definition
      }
      const last = m[0].split('.').pop() ?? m[0];
      out.push({ line: row, character: at + m[0].length - last.length });
    }
  });
  return out;
}

export class Definitions {
  private found = new Map<string, { key: string; items: ContextItem[]; generation: number }>();

  constructor(
    private readonly host: DefinitionHost,
    private readonly limits: () => DefinitionLimits,
    /** Whether a document may be read (privacy.ts), asked for each definition's file. */
    private readonly readable: (uri: string, languageId: string) => boolean,
  ) {}

  /** The definitions found for `uri` so far (never waits for a lookup). */
  forRequest(uri: string): ContextItem[] {
    return this.found.get(uri)?.items ?? [];
  }

  closed(uri: string): void {
    this.found.delete(uri);
  }

  /** Look the document's imported names up again if its import lines changed; resolves when done. */
  async refresh(doc: { uri: string; languageId: string; text: string }): Promise<void> {
    const { max, maxChars } = this.limits();
    if (doc.languageId !== 'python' || max <= 0 || !this.readable(doc.uri, doc.languageId)) {
      return;
    }
    const lines = doc.text.split('\n', SCAN_LINES);
    const positions = importPositions(doc.text).slice(0, Math.floor(max));
    const key = positions.map((p) => lines[p.line]).join('\n');
    const state = this.found.get(doc.uri);
    if (state?.key === key) {
      return;
    }
    const generation = (state?.generation ?? 0) + 1;
    const mine = { key, items: state?.items ?? [], generation };
    this.found.set(doc.uri, mine);
    const snippets = await Promise.all(positions.map(async (p) => {
      try {
        const [target] = (await this.host.lookup(doc.uri, p.line, p.character)).filter((t) => t.uri !== doc.uri);
        if (!target) {
          return undefined;
        }
        // The path alone first: an excluded file is not even opened.
        if (!this.readable(target.uri, '*')) {
          return undefined;
        }
        const read = await this.host.read(target.uri, target.line, SNIPPET_LINES);
        if (!read || !read.text.trim() || !this.readable(target.uri, read.languageId)) {
          return undefined;
        }
        const item: ContextItem = { uri: target.uri, text: read.text.slice(0, maxChars), kind: 'definition' };
        return item;
      } catch {
        return undefined; // no language server, or it failed: no definition, no error for the user
      }
    }));
    if (this.found.get(doc.uri) !== mine) {
      return; // closed, or a newer lookup started: its answer counts
    }
    const seen = new Set<string>();
    mine.items = snippets.filter((s): s is ContextItem => {
      const id = s ? `${s.uri}\0${s.text}` : '';
      return s !== undefined && !seen.has(id) && seen.add(id) !== undefined;
    });
    if (mine.items.length === 0 && positions.length > 0) {
      mine.key = ''; // the language server may still be starting: look again next time
    }
  }
}
