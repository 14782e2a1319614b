// The value types of the fake `vscode` module (fake-vscode.ts): disposables,
// events, positions and ranges, cancellation, URIs, the secret storage.

export type Listener<T> = (e: T) => unknown;

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


export class FakeSecretStorage {
  readonly values = new Map<string, string>();
  private emitter = new EventEmitter<{ key: string }>();
  readonly onDidChange = this.emitter.event;
  get(key: string): Promise<string | undefined> {
    return Promise.resolve(this.values.get(key));
  }
  store(key: string, value: string): Promise<void> {
    this.values.set(key, value);
    this.emitter.fire({ key });
    return Promise.resolve();
  }
  delete(key: string): Promise<void> {
    this.values.delete(key);
    this.emitter.fire({ key });
    return Promise.resolve();
  }
}
