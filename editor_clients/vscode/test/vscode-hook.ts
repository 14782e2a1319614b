// Import first in every test file: `require('vscode')` then loads the fake.

import Module from 'node:module';

const fakePath = require.resolve('./fake-vscode');
const M = Module as unknown as { _resolveFilename: (request: string, ...rest: unknown[]) => string };
const original = M._resolveFilename;
M._resolveFilename = function resolve(this: unknown, request: string, ...rest: unknown[]): string {
  return request === 'vscode' ? fakePath : original.call(this, request, ...rest);
};
