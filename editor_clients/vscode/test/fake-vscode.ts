// A small stand-in for the `vscode` module: only the API surface the
// extension uses, plus a `fake` object the tests drive it with. It plays the
// workbench's part too: typing cancels the provider call in flight and asks
// again, the ghost text of the last item, Tab / next word / next line / Escape.

/* eslint-disable @typescript-eslint/no-explicit-any */

type Listener<T> = (e: T) => unknown;

export class Disposable {
  constructor(private readonly fn: () => void = () => undefined) {}
  static from(...items: { dispose(): unknown }[]): Disposable {
    return new Disposable(() => items.forEach((d) => d.dispose()));
  }
  dispose(): void {
    this.fn();
  }
}

export class EventEmitter<T> {
  private listeners = new Set<Listener<T>>();
  readonly event = (listener: Listener<T>): Disposable => {
    this.listeners.add(listener);
    return new Disposable(() => this.listeners.delete(listener));
  };
  fire(e: T): void {
    [...this.listeners].forEach((l) => l(e));
  }
  dispose(): void {
    this.listeners.clear();
  }
}

export class Position {
  constructor(readonly line: number, readonly character: number) {}
  isEqual(o: Position): boolean {
    return this.line === o.line && this.character === o.character;
  }
  isBefore(o: Position): boolean {
    return this.line < o.line || (this.line === o.line && this.character < o.character);
  }
}

export class Range {
  readonly start: Position;
  readonly end: Position;
  constructor(a: Position, b: Position) {
    [this.start, this.end] = b.isBefore(a) ? [b, a] : [a, b];
  }
  get isEmpty(): boolean {
    return this.start.isEqual(this.end);
  }
}

export class Selection extends Range {
  constructor(readonly anchor: Position, readonly active: Position) {
    super(anchor, active);
  }
}

export enum InlineCompletionTriggerKind { Invoke = 0, Automatic = 1 }
export enum StatusBarAlignment { Left = 1, Right = 2 }
export enum ConfigurationTarget { Global = 1, Workspace = 2, WorkspaceFolder = 3 }

export class ThemeColor {
  constructor(readonly id: string) {}
}

export interface Command {
  title: string;
  command: string;
  arguments?: unknown[];
}

export class InlineCompletionItem {
  constructor(public insertText: string, public range?: Range, public command?: Command) {}
}

export class CancellationTokenSource {
  private emitter = new EventEmitter<void>();
  private cancelled = false;
  readonly token: { readonly isCancellationRequested: boolean; onCancellationRequested(l: Listener<void>): Disposable };

  constructor() {
    const source = this; // eslint-disable-line @typescript-eslint/no-this-alias
    this.token = {
      get isCancellationRequested(): boolean {
        return source.cancelled;
      },
      onCancellationRequested(listener: Listener<void>): Disposable {
        if (source.cancelled) { // as VS Code: an already cancelled token calls back soon
          const t = setTimeout(() => listener(undefined), 0);
          return new Disposable(() => clearTimeout(t));
        }
        return source.emitter.event(listener);
      },
    };
  }

  cancel(): void {
    if (!this.cancelled) {
      this.cancelled = true;
      this.emitter.fire();
    }
  }

  dispose(): void {
    this.emitter.dispose();
  }
}

export class Uri {
  private constructor(readonly scheme: string, private readonly value: string) {}
  static parse(value: string): Uri {
    return new Uri(value.slice(0, value.indexOf(':')), value);
  }
  toString(): string {
    return this.value;
  }
}

export class FakeDocument {
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
  /** Replace [start, end) with `text`. */
  edit(start: number, end: number, text: string): void {
    this.text = this.text.slice(0, start) + text + this.text.slice(end);
    this.version += 1;
  }
}

export class FakeEditor {
  selections: Selection[];
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

export interface StatusItem {
  text: string;
  tooltip?: string;
  name?: string;
  command?: string;
  backgroundColor?: ThemeColor;
  visible: boolean;
  show(): void;
  hide(): void;
  dispose(): void;
}

interface Ghost {
  item: InlineCompletionItem;
  editor: FakeEditor;
  /** Offset where the ghost text starts. */
  at: number;
  /** How much of item.insertText is already in the document (partial accepts). */
  done: number;
}

type Provider = {
  provideInlineCompletionItems(doc: any, pos: any, ctx: any, token: any): Promise<InlineCompletionItem[] | undefined> | InlineCompletionItem[] | undefined;
};

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

class FakeState {
  config: Record<string, unknown> = {};
  commands = new Map<string, (...args: any[]) => unknown>();
  executed: { command: string; args: unknown[] }[] = [];
  contextKeys: Record<string, unknown> = {};
  providers: Provider[] = [];
  statusItems: StatusItem[] = [];
  output: string[] = [];
  messages: { error: string[]; warning: string[]; info: string[] } = { error: [], warning: [], info: [] };
  editors: FakeEditor[] = [];
  activeEditor: FakeEditor | undefined;
  ghost: Ghost | undefined;
  /** The provider call in flight, cancelled by the next edit. */
  pending: CancellationTokenSource | undefined;
  onConfig = new EventEmitter<{ affectsConfiguration(s: string): boolean }>();
  onSelection = new EventEmitter<{ textEditor: FakeEditor; selections: Selection[]; kind: number | undefined }>();
  onActiveEditor = new EventEmitter<FakeEditor | undefined>();
}

let state = new FakeState();

function builtins(): void {
  const s = state;
  s.commands.set('setContext', (key: string, value: unknown) => {
    s.contextKeys[key] = value;
  });
  s.commands.set('editor.action.inlineSuggest.hide', () => {
    s.ghost = undefined;
  });
  const insertPart = (pick: (rest: string) => string) => {
    const g = s.ghost;
    if (!g) {
      return;
    }
    const rest = g.item.insertText.slice(g.done);
    const part = pick(rest);
    fake.insertAtCursor(g.editor, part, false);
    g.done += part.length;
    if (g.done >= g.item.insertText.length) {
      s.ghost = undefined;
      return runItemCommand(g.item);
    }
    return undefined;
  };
  s.commands.set('editor.action.inlineSuggest.commit', () => insertPart((rest) => rest));
  s.commands.set('editor.action.inlineSuggest.acceptNextWord', () => insertPart(nextWord));
  s.commands.set('editor.action.inlineSuggest.acceptNextLine', () => insertPart(nextLine));
}
builtins();

function runItemCommand(item: InlineCompletionItem): unknown {
  if (item.command) {
    return commands.executeCommand(item.command.command, ...(item.command.arguments ?? []));
  }
  return undefined;
}

/** The test's handle on the fake. */
export const fake = {
  get state(): FakeState {
    return state;
  },
  reset(config: Record<string, unknown> = {}): void {
    state.pending?.cancel();
    state = new FakeState();
    state.config = { ...config };
    builtins();
  },
  /** Open a document in an editor and make it active; `|` in `text` marks the cursor. */
  open(uri: string, languageId: string, text: string, active = true): FakeEditor {
    const cursor = text.indexOf('|');
    const doc = new FakeDocument(uri, languageId, cursor >= 0 ? text.slice(0, cursor) + text.slice(cursor + 1) : text);
    const editor = new FakeEditor(doc, cursor >= 0 ? cursor : doc.getText().length);
    state.editors.push(editor);
    if (active) {
      state.activeEditor = editor;
      state.onActiveEditor.fire(editor);
    }
    return editor;
  },
  get provider(): Provider {
    if (state.providers.length !== 1) {
      throw new Error(`${state.providers.length} inline completion providers registered`);
    }
    return state.providers[0];
  },
  /** Ask the provider at the active editor's cursor, as VS Code does (cancelling the call before). */
  async trigger(kind: InlineCompletionTriggerKind = InlineCompletionTriggerKind.Invoke,
    cts = new CancellationTokenSource()): Promise<InlineCompletionItem[] | undefined> {
    const editor = state.activeEditor;
    if (!editor) {
      throw new Error('no active editor');
    }
    state.pending?.cancel();
    state.pending = cts;
    const version = editor.document.version;
    const items = await fake.provider.provideInlineCompletionItems(editor.document, editor.selection.active,
      { triggerKind: kind, selectedCompletionInfo: undefined }, cts.token);
    if (state.pending === cts) {
      state.pending = undefined;
    }
    const list = items ?? [];
    if (!cts.token.isCancellationRequested && editor.document.version === version && list.length > 0) {
      state.ghost = { item: list[0], editor, at: editor.cursor, done: 0 };
    } else if (list.length === 0 && !cts.token.isCancellationRequested) {
      state.ghost = undefined;
    }
    return items;
  },
  /** Insert `text` at the cursor; when `typed`, it is a keystroke: the call in flight is cancelled, the ghost hidden. */
  insertAtCursor(editor: FakeEditor, text: string, typed = true): void {
    if (typed) {
      state.pending?.cancel();
      state.ghost = undefined;
    }
    const at = editor.cursor;
    editor.document.edit(at, at, text);
    const p = editor.document.positionAt(at + text.length);
    editor.selections = [new Selection(p, p)];
    state.onSelection.fire({ textEditor: editor, selections: editor.selections, kind: typed ? 1 : undefined });
  },
  /** Type `text` one character at a time; each keystroke triggers the provider (automatic). Returns each call's promise. */
  type(text: string): Promise<InlineCompletionItem[] | undefined>[] {
    const editor = state.activeEditor;
    if (!editor) {
      throw new Error('no active editor');
    }
    return [...text].map((ch) => {
      fake.insertAtCursor(editor, ch);
      return fake.trigger(InlineCompletionTriggerKind.Automatic);
    });
  },
  select(editor: FakeEditor, ...ranges: [number, number][]): void {
    editor.selections = ranges.map(([a, b]) => new Selection(editor.document.positionAt(a), editor.document.positionAt(b)));
    state.onSelection.fire({ textEditor: editor, selections: editor.selections, kind: 2 });
  },
  /** Run a command as a keybinding would. */
  commandsRun<T = unknown>(name: string, ...args: unknown[]): Promise<T> {
    return commands.executeCommand<T>(name, ...args);
  },
  setConfig(values: Record<string, unknown>): void {
    Object.assign(state.config, values);
    state.onConfig.fire({ affectsConfiguration: (s: string) => s === 'completer' || s.startsWith('completer.') });
  },
};

export const window = {
  get activeTextEditor(): FakeEditor | undefined {
    return state.activeEditor;
  },
  get visibleTextEditors(): FakeEditor[] {
    return [...state.editors];
  },
  createStatusBarItem(): StatusItem {
    const item: StatusItem = {
      text: '', visible: false,
      show() { item.visible = true; },
      hide() { item.visible = false; },
      dispose() { item.visible = false; },
    };
    state.statusItems.push(item);
    return item;
  },
  createOutputChannel(name: string) {
    return {
      name,
      appendLine: (line: string) => state.output.push(line),
      append: (text: string) => state.output.push(text),
      show: () => undefined,
      clear: () => undefined,
      dispose: () => undefined,
    };
  },
  showErrorMessage(message: string): Promise<undefined> {
    state.messages.error.push(message);
    return Promise.resolve(undefined);
  },
  showWarningMessage(message: string): Promise<undefined> {
    state.messages.warning.push(message);
    return Promise.resolve(undefined);
  },
  showInformationMessage(message: string): Promise<undefined> {
    state.messages.info.push(message);
    return Promise.resolve(undefined);
  },
  onDidChangeTextEditorSelection: (l: Listener<any>) => state.onSelection.event(l),
  onDidChangeActiveTextEditor: (l: Listener<any>) => state.onActiveEditor.event(l),
};

export const workspace = {
  get textDocuments(): FakeDocument[] {
    return state.editors.map((e) => e.document);
  },
  getConfiguration(section: string) {
    const key = (k: string) => `${section}.${k}`;
    return {
      get<T>(k: string, fallback?: T): T | undefined {
        return key(k) in state.config ? (state.config[key(k)] as T) : fallback;
      },
      update(k: string, value: unknown): Promise<void> {
        fake.setConfig({ [key(k)]: value });
        return Promise.resolve();
      },
    };
  },
  onDidChangeConfiguration: (l: Listener<any>) => state.onConfig.event(l),
};

export const commands = {
  registerCommand(name: string, fn: (...args: any[]) => unknown): Disposable {
    if (state.commands.has(name)) {
      throw new Error(`command ${name} already registered`);
    }
    state.commands.set(name, fn);
    return new Disposable(() => state.commands.delete(name));
  },
  async executeCommand<T>(name: string, ...args: unknown[]): Promise<T> {
    state.executed.push({ command: name, args });
    const fn = state.commands.get(name);
    if (!fn) {
      throw new Error(`command '${name}' not found`);
    }
    return (await fn(...args)) as T;
  },
};

export const languages = {
  registerInlineCompletionItemProvider(_selector: unknown, provider: Provider): Disposable {
    state.providers.push(provider);
    return new Disposable(() => {
      state.providers = state.providers.filter((p) => p !== provider);
    });
  },
};
