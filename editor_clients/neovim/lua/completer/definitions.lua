-- The definitions of the names a buffer imports, found by its language
-- server (textDocument/definition) and sent as context of kind "definition";
-- and the request's `workspace`: the language server's root, else the cwd.
--
-- Never on a keystroke's path: the lookups start when a buffer is entered,
-- an insert ends or a language server attaches, only when the import lines
-- changed since the last ones, and their answers land in a cache that the
-- next request reads. Secrets stay out as for any context (privacy.lua).
local api = vim.api
local privacy = require('completer.privacy')

local M = {}
local D = {}
D.__index = D

local SCAN_LINES = 300 -- imports sit at the top; a huge file is not scanned whole
local MAX_FILE_BYTES = 1024 * 1024

function M.new(cfg)
  return setmetatable({ cfg = cfg, bufs = {} }, D)
end

-- The language servers attached to `buf` (0.7 has no vim.lsp.get_clients).
local function clients(buf)
  if vim.lsp.get_clients then return vim.lsp.get_clients({ bufnr = buf }) end
  local out = {}
  for _, c in pairs(vim.lsp.buf_get_clients(buf)) do out[#out + 1] = c end
  return out
end

--- The workspace folder URI of `buf`: its language server's root when one
--- is attached (what the editor calls the project), else the cwd.
function M.workspace(buf)
  for _, c in ipairs(clients(buf)) do
    local root = c.config and c.config.root_dir
    if type(root) == 'string' and root ~= '' then return vim.uri_from_fname(root) end
  end
  return vim.uri_from_fname(vim.fn.getcwd())
end
D.workspace = M.workspace

--- Where the imported names of Python `lines` are: { row, col } (0-based) of
--- each name bound (`from a import b as c`: b; `import a.b`: b).
function M.import_positions(lines)
  local out = {}
  local open = false -- inside `from x import (` ... `)`
  local function names(line, from_col)
    local col = from_col
    while true do
      local s, e = line:find('[%a_][%w_%.]*', col)
      if not s then return end
      local word = line:sub(s, e)
      if word ~= 'as' and word ~= 'import' and line:sub(s - 3, s - 2) ~= 'as' then
        local last = word:match('([%a_][%w_]*)$')
        out[#out + 1] = { line = line, col = e - #last }
      end
      col = e + 1
    end
  end
  for row, line in ipairs(lines) do
    local before = #out
    if open then
      names(line:gsub('#.*', ''), 1)
      if line:find(')', 1, true) then open = false end
    else
      local _, e = line:find('^%s*from%s+[%w_%.]+%s+import%s+')
      if e then
        names(line:gsub('#.*', ''), e + 1)
        open = line:find('(', e, true) ~= nil and not line:find(')', e, true)
      else
        _, e = line:find('^%s*import%s+')
        if e then names(line:gsub('#.*', ''), e + 1) end
      end
    end
    for i = before + 1, #out do out[i] = { row - 1, out[i].col } end
  end
  return out
end

-- The snippet a location points at: chunk_lines lines from its start, from
-- the loaded buffer if there is one (unsaved edits), else from the file.
function D:snippet(uri, line)
  local fname = vim.uri_to_fname(uri)
  if privacy.excluded(fname, self.cfg) then return nil end
  local cc = self.cfg.context
  local lines
  local b = vim.fn.bufnr(fname)
  if b ~= -1 and api.nvim_buf_is_loaded(b) then
    if privacy.blocked(b, self.cfg) then return nil end
    lines = api.nvim_buf_get_lines(b, line, line + cc.chunk_lines, false)
  else
    local size = vim.fn.getfsize(fname)
    if size < 0 or size > MAX_FILE_BYTES then return nil end
    local ok, all = pcall(vim.fn.readfile, fname, '', line + cc.chunk_lines)
    if not ok then return nil end
    lines = { unpack(all, line + 1) }
  end
  local body = table.concat(lines, '\n'):sub(1, math.max(1, math.floor(cc.max_chars / 2)))
  if not body:find('%S') then return nil end
  return { uri = uri, text = body, kind = 'definition' }
end

--- The definitions found for `buf` so far (a cached list; never waits).
function D:items(buf)
  local st = self.bufs[buf]
  return st and st.items or {}
end

function D:forget(buf) self.bufs[buf] = nil end

--- Look up the definitions of `buf`'s imported names again if its import
--- lines changed; the answers arrive later, into items().
function D:refresh(buf)
  local max = self.cfg.context.definitions
  if not self.cfg.context.enabled or max <= 0 or not api.nvim_buf_is_loaded(buf)
      or privacy.blocked(buf, self.cfg) or #clients(buf) == 0 then return end
  local lines = api.nvim_buf_get_lines(buf, 0, SCAN_LINES, false)
  local positions = M.import_positions(lines)
  local key = {}
  for _, p in ipairs(positions) do key[#key + 1] = lines[p[1] + 1] end
  key = table.concat(key, '\n')
  local st = self.bufs[buf] or { items = {} }
  self.bufs[buf] = st
  if st.key == key then return end
  st.key, st.gen = key, (st.gen or 0) + 1
  local gen, uri, found, answered = st.gen, vim.uri_from_fname(api.nvim_buf_get_name(buf)), {}, 0
  local asked = math.min(#positions, max)
  for i = 1, asked do
    local params = { textDocument = { uri = uri }, position = { line = positions[i][1], character = positions[i][2] } }
    vim.lsp.buf_request(buf, 'textDocument/definition', params, function(err, result)
      if st.gen ~= gen then return end -- the imports changed since: a newer lookup is on its way
      answered = answered + 1
      if err then
        if answered >= asked and vim.tbl_isempty(found) then st.key = nil end -- retried on the next event
        return
      end
      if result and (result.uri or result.targetUri) then result = { result } end
      for _, loc in ipairs(result or {}) do
        local target = loc.uri or loc.targetUri
        local range = loc.targetRange or loc.range
        if target and range and target ~= uri and not found[i] then
          found[i] = self:snippet(target, range.start.line)
        end
      end
      local items, seen = {}, {}
      for j = 1, asked do
        local d = found[j]
        if d and not seen[d.uri .. '\0' .. d.text] then
          seen[d.uri .. '\0' .. d.text] = true
          items[#items + 1] = d
        end
      end
      st.items = items
    end)
  end
end

return M
