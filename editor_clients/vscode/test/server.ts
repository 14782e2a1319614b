// The real `completer serve` for the tests: default models, an ephemeral (or
// given) port, started and stopped per test file.

import { ChildProcess, spawn } from 'child_process';
import * as fs from 'fs';
import * as net from 'net';
import * as path from 'path';

/** A protocol message as sent or received (the fields the tests look at). */
export interface Msg {
  type: string;
  id?: string | null;
  text?: string;
  reason?: string;
  code?: string;
  accepted_chars?: number;
  mode?: string;
  document?: { uri: string; language: string; prefix: string; suffix: string };
  context?: { uri: string; text: string }[];
  [key: string]: unknown;
}

/** out/test -> editor_clients/vscode -> editor_clients -> the repository. */
export const REPO_ROOT = path.resolve(__dirname, '..', '..', '..', '..');

export function pythonExecutable(): string {
  if (process.env.COMPLETER_PYTHON) {
    return process.env.COMPLETER_PYTHON;
  }
  const venv = path.join(REPO_ROOT, '.venv', 'bin', 'python');
  return fs.existsSync(venv) ? venv : 'python3';
}

export class Server {
  private constructor(readonly proc: ChildProcess, readonly port: number, readonly log: string[],
    readonly token: string) {}

  get url(): string {
    return `ws://127.0.0.1:${this.port}/v1/ws`;
  }

  get http(): string {
    return `http://127.0.0.1:${this.port}`;
  }

  /**
   * Start `completer serve` and resolve once it prints `ready`. `model`: the
   * small one in the package by default; `default` is SmolLM2-135M (fetched
   * into the user's cache once, as the Python tests' `default_model` does).
   */
  static start(token: string, port = 0, timeoutMs = 120_000, model = 'embedded'): Promise<Server> {
    const proc = spawn(pythonExecutable(), ['-u', '-m', 'completer.cli', 'serve', '--model', model, '--port', String(port), '--token', token,
      '--set', 'engine.threads=1',
      // The embedded model is unsure nearly everywhere: these tests are of the extension, not of the server's
      // confidence rules (tests/server/test_confidence.py), so they are off.
      '--set', 'request.min_first_prob=0', '--set', 'request.min_token_prob=0', '--set', 'request.min_line_prob=0'], {
      cwd: REPO_ROOT,
      env: { ...process.env, OMP_NUM_THREADS: '1', PYTHONUNBUFFERED: '1' },
      stdio: ['ignore', 'pipe', 'pipe'],
    });
    const log: string[] = [];
    return new Promise((resolve, reject) => {
      let found: number | undefined;
      let buffer = '';
      const timer = setTimeout(() => {
        proc.kill('SIGKILL');
        reject(new Error(`server not ready after ${timeoutMs} ms:\n${log.join('')}`));
      }, timeoutMs);
      proc.stderr?.on('data', (d: Buffer) => log.push(d.toString()));
      proc.stdout?.on('data', (d: Buffer) => {
        buffer += d.toString();
        let nl: number;
        while ((nl = buffer.indexOf('\n')) >= 0) {
          const line = buffer.slice(0, nl + 1);
          buffer = buffer.slice(nl + 1);
          log.push(line);
          const m = /ws:\/\/127\.0\.0\.1:(\d+)\/v1\/ws/.exec(line);
          if (m) {
            found = Number(m[1]);
          }
          if (line.includes('ready') && found !== undefined) {
            clearTimeout(timer);
            resolve(new Server(proc, found, log, token));
          }
        }
      });
      proc.on('exit', (code, signal) => {
        clearTimeout(timer);
        reject(new Error(`server exited (${code ?? signal}) before ready:\n${log.join('')}`));
      });
    });
  }

  /** SIGTERM (graceful) or SIGKILL (a crash); resolves when the process is gone. */
  stop(signal: NodeJS.Signals = 'SIGTERM'): Promise<void> {
    const proc = this.proc;
    if (proc.exitCode !== null || proc.signalCode !== null) {
      return Promise.resolve();
    }
    return new Promise((resolve) => {
      const timer = setTimeout(() => proc.kill('SIGKILL'), 20_000);
      proc.once('exit', () => {
        clearTimeout(timer);
        resolve();
      });
      proc.kill(signal);
    });
  }

  /** A Prometheus counter from /metrics (0 when absent; the route needs the token). */
  async counter(name: string): Promise<number> {
    const response = await fetch(`${this.http}/metrics`, { headers: { Authorization: `Bearer ${this.token}` } });
    if (!response.ok) {
      throw new Error(`/metrics answered ${response.status}`);
    }
    const text = await response.text();
    const m = new RegExp(`^${name} ([0-9.e+-]+)$`, 'm').exec(text);
    return m ? Number(m[1]) : 0;
  }
}

/** A port nothing listens on (bound, then released). */
export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.on('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const port = (srv.address() as net.AddressInfo).port;
      srv.close(() => resolve(port));
    });
  });
}

/** Poll `check` every 20 ms until it is truthy; fail with `what` after `timeoutMs`. */
export async function waitFor<T>(check: () => T | Promise<T>, what: string, timeoutMs = 15_000): Promise<NonNullable<T>> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const v = await check();
    if (v) {
      return v;
    }
    if (Date.now() > deadline) {
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    }
    await new Promise((r) => setTimeout(r, 20));
  }
}
