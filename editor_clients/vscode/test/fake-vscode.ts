// A small stand-in for the `vscode` module: only the API surface the
// extension uses, plus a `fake` object the tests drive it with. It plays the
// workbench's part too: typing cancels the provider call in flight and asks
// again, the ghost text of the last item, Tab / next word / next line / Escape.

/* eslint-disable @typescript-eslint/no-explicit-any */

import {
  CancellationTokenSource, Disposable, EventEmitter, FakeSecretStorage, InlineCompletionItem, InlineCompletionTriggerKind,
  Listener, Range, Selection, ThemeColor, Uri,
} from './fake-basics';
import { DocumentChange, FakeDocument, FakeEditor, nextLine, nextWord } from './fake-documents';

export * from './fake-basics';
export * from './fake-documents';
export interface StatusItem {
  text: string;
  /** Every text the item was given, in order (a spinner shown for a moment is seen here). */
  texts: string[];
  tooltip?: string;
  name?: string;
  command?: string;
  backgroundColor?: ThemeColor;
  visible: boolean;
  show(): void;
  hide(): void;
  dispose(): void;
}

/** The suggest widget's selected item (InlineCompletionContext.selectedCompletionInfo). */
export interface SelectedCompletionInfo {
  range: Range;
  text: string;
}

interface Ghost {
  item: InlineCompletionItem;
  /** Every item of the list the provider gave; `item` is one of them (Alt+] cycles). */
  items: InlineCompletionItem[];
  editor: FakeEditor;
  /** Offset where the ghost text starts. */
  at: number;
  /** How much of item.insertText is already in the document (partial accepts). */
  done: number;
}

type Provider = {
  provideInlineCompletionItems(doc: any, pos: any, ctx: any, token: any): Promise<InlineCompletionItem[] | undefined> | InlineCompletionItem[] | undefined;
};

/** VS Code's SecretStorage, in memory. */

class FakeState {
  config: Record<string, unknown> = {};
  secrets = new FakeSecretStorage();
  /** Answers the next showInputBox calls give, in order (undefined: the box was cancelled). */
  inputAnswers: (string | undefined)[] = [];
  commands = new Map<string, (...args: any[]) => unknown>();
  executed: { command: string; args: unknown[] }[] = [];
  contextKeys: Record<string, unknown> = {};
  providers: Provider[] = [];
  statusItems: StatusItem[] = [];
  output: string[] = [];
  messages: { error: string[]; warning: string[]; info: string[] } = { error: [], warning: [], info: [] };
  editors: FakeEditor[] = [];
  /** Workspace folders' URIs (a document belongs to the longest one its URI starts with). */
  workspaceFolders: string[] = [];
  /** Documents on "disk" that openTextDocument finds without an editor: URI -> language and text. */
  files = new Map<string, { languageId: string; text: string }>();
  activeEditor: FakeEditor | undefined;
  ghost: Ghost | undefined;
  /** The provider call in flight, cancelled by the next edit. */
  pending: CancellationTokenSource | undefined;
  onConfig = new EventEmitter<{ affectsConfiguration(s: string): boolean }>();
  onSelection = new EventEmitter<{ textEditor: FakeEditor; selections: Selection[]; kind: number | undefined }>();
  onActiveEditor = new EventEmitter<FakeEditor | undefined>();
  onChange = new EventEmitter<DocumentChange>();
  onOpen = new EventEmitter<FakeDocument>();
  onClose = new EventEmitter<FakeDocument>();
}

let state = new FakeState();
FakeDocument.edited.event((e) => state.onChange.fire(e));

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
  s.commands.set('editor.action.inlineSuggest.showNext', () => {
    const g = s.ghost;
    if (g && g.done === 0) {
      g.item = g.items[(g.items.indexOf(g.item) + 1) % g.items.length];
    }
  });
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
  /** The ExtensionContext `activate` gets: its subscriptions, and the secret storage (kept until `reset`). */
  context(): { subscriptions: { dispose(): unknown }[]; secrets: FakeSecretStorage } {
    return { subscriptions: [], secrets: state.secrets };
  },
  /** Open a document in an editor and make it active; `|` in `text` marks the cursor. */
  open(uri: string, languageId: string, text: string, active = true): FakeEditor {
    const cursor = text.indexOf('|');
    const doc = new FakeDocument(uri, languageId, cursor >= 0 ? text.slice(0, cursor) + text.slice(cursor + 1) : text);
    const editor = new FakeEditor(doc, cursor >= 0 ? cursor : doc.getText().length);
    state.editors.push(editor);
    state.onOpen.fire(doc);
    if (active) {
      fake.activate(editor);
    }
    return editor;
  },
  /** Make `editor` the active one (as clicking into it does). */
  activate(editor: FakeEditor): void {
    state.activeEditor = editor;
    state.onActiveEditor.fire(editor);
  },
  /** Close `editor` and its document. */
  close(editor: FakeEditor): void {
    state.editors = state.editors.filter((e) => e !== editor);
    if (state.activeEditor === editor) {
      state.activeEditor = undefined;
      state.onActiveEditor.fire(undefined);
    }
    state.onClose.fire(editor.document);
  },
  get provider(): Provider {
    if (state.providers.length !== 1) {
      throw new Error(`${state.providers.length} inline completion providers registered`);
    }
    return state.providers[0];
  },
  /**
   * Ask the provider at the active editor's cursor, as VS Code does (cancelling the call before).
   * `selected`: the suggest widget is open with this item selected (its text would replace its range);
   * the suggest widget then owns the keys, so no ghost text is kept for Tab and the accept commands.
   */
  async trigger(kind: InlineCompletionTriggerKind = InlineCompletionTriggerKind.Invoke,
    cts = new CancellationTokenSource(), selected?: SelectedCompletionInfo): Promise<InlineCompletionItem[] | undefined> {
    const editor = state.activeEditor;
    if (!editor) {
      throw new Error('no active editor');
    }
    state.pending?.cancel();
    state.pending = cts;
    const version = editor.document.version;
    const items = await fake.provider.provideInlineCompletionItems(editor.document, editor.selection.active,
      { triggerKind: kind, selectedCompletionInfo: selected }, cts.token);
    if (state.pending === cts) {
      state.pending = undefined;
    }
    const list = items ?? [];
    if (selected) {
      state.ghost = undefined;
    } else if (!cts.token.isCancellationRequested && editor.document.version === version && list.length > 0) {
      state.ghost = { item: list[0], items: list, editor, at: editor.cursor, done: 0 };
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
  /** An opening bracket or quote typed where VS Code closes the pair: one edit of both characters, the cursor between them. */
  typeAutoClosed(editor: FakeEditor, pair: string): void {
    state.pending?.cancel();
    state.ghost = undefined;
    const at = editor.cursor;
    editor.document.edit(at, at, pair);
    const p = editor.document.positionAt(at + 1);
    editor.selections = [new Selection(p, p)];
    state.onSelection.fire({ textEditor: editor, selections: editor.selections, kind: 1 });
  },
  /** Delete the character before the cursor, as Backspace does (a keystroke). */
  deleteBeforeCursor(editor: FakeEditor): void {
    state.pending?.cancel();
    state.ghost = undefined;
    const at = editor.cursor;
    const before = editor.document.getText().slice(0, at);
    const width = /[\udc00-\udfff]$/.test(before) && before.length >= 2 ? 2 : 1; // a surrogate pair is one character
    editor.document.edit(at - width, at, '');
    const p = editor.document.positionAt(at - width);
    editor.selections = [new Selection(p, p)];
    state.onSelection.fire({ textEditor: editor, selections: editor.selections, kind: 1 });
  },
  /**
   * Type `text` one character (code point) at a time, `\b` being Backspace;
   * each keystroke triggers the provider (automatic). Returns each call's promise.
   */
  type(text: string): Promise<InlineCompletionItem[] | undefined>[] {
    const editor = state.activeEditor;
    if (!editor) {
      throw new Error('no active editor');
    }
    return [...text].map((ch) => {
      if (ch === '\b') {
        fake.deleteBeforeCursor(editor);
      } else {
        fake.insertAtCursor(editor, ch);
      }
      return fake.trigger(InlineCompletionTriggerKind.Automatic);
    });
  },
  /**
   * The suggest widget's item accepted: its text replaces its range (one edit, the cursor after it),
   * as VS Code inserts a completion item.
   */
  acceptSuggestItem(editor: FakeEditor, selected: SelectedCompletionInfo): void {
    state.pending?.cancel();
    state.ghost = undefined;
    const start = editor.document.offsetAt(selected.range.start);
    editor.document.edit(start, editor.document.offsetAt(selected.range.end), selected.text);
    const p = editor.document.positionAt(start + selected.text.length);
    editor.selections = [new Selection(p, p)];
    state.onSelection.fire({ textEditor: editor, selections: editor.selections, kind: undefined });
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
    let text = '';
    const item: StatusItem = {
      get text() {
        return text;
      },
      set text(value: string) {
        text = value;
        item.texts.push(value);
      },
      texts: [], visible: false,
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
  showInputBox(_options?: { password?: boolean }): Promise<string | undefined> {
    if (state.inputAnswers.length === 0) {
      throw new Error('showInputBox: the test gave no answer');
    }
    return Promise.resolve(state.inputAnswers.shift());
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
      /** Every value is a user (global) setting here. */
      inspect<T>(k: string): { key: string; globalValue?: T; workspaceValue?: T; workspaceFolderValue?: T } {
        return key(k) in state.config ? { key: key(k), globalValue: state.config[key(k)] as T } : { key: key(k) };
      },
      update(k: string, value: unknown): Promise<void> {
        if (value === undefined) {
          delete state.config[key(k)];
          fake.setConfig({});
        } else {
          fake.setConfig({ [key(k)]: value });
        }
        return Promise.resolve();
      },
    };
  },
  getWorkspaceFolder(uri: Uri): { uri: Uri; name: string; index: number } | undefined {
    const value = uri.toString();
    const found = state.workspaceFolders.filter((f) => value.startsWith(f.endsWith('/') ? f : `${f}/`))
      .sort((a, b) => b.length - a.length)[0];
    return found === undefined ? undefined : { uri: Uri.parse(found), name: found, index: state.workspaceFolders.indexOf(found) };
  },
  /** An open document, or one of `fake.state.files` (opened without an editor, as VS Code does). */
  openTextDocument(uri: Uri): Promise<FakeDocument> {
    const open = state.editors.find((e) => e.document.uri.toString() === uri.toString());
    const file = state.files.get(uri.toString());
    if (open) {
      return Promise.resolve(open.document);
    }
    return file ? Promise.resolve(new FakeDocument(uri.toString(), file.languageId, file.text))
      : Promise.reject(new Error(`cannot open ${uri.toString()}`));
  },
  onDidChangeConfiguration: (l: Listener<any>) => state.onConfig.event(l),
  onDidChangeTextDocument: (l: Listener<any>) => state.onChange.event(l),
  onDidOpenTextDocument: (l: Listener<any>) => state.onOpen.event(l),
  onDidCloseTextDocument: (l: Listener<any>) => state.onClose.event(l),
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
