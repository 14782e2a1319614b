-- Snippets of other code sent with each request (`context`), chosen as
-- llama.vim's ring buffer does: ranges the user recently edited, yanked, or
-- left the cursor in, newest first, then the text around the cursor of other
-- loaded buffers of the same filetype. Each item carries its `kind` (the
-- server ranks recent edits a little ahead): "edit", "yank", "visited" (the
-- cursor's lines of a buffer left), "open" (another loaded buffer).
--
-- The server puts the context first in the prompt, so a chunk that changes
-- means re-prefilling everything after it. The list is therefore kept still
-- while the user types: chunks are picked only outside insert mode (when an
-- insert ends, on yank, when a buffer is left), each is a snapshot of its
-- text when picked, and the list built for a request is reused until one of
-- those events (or entering insert mode or another buffer) changes it.
local api = vim.api
local privacy = require('completer.privacy')
local text = require('completer.text')

local M = {}
local C = {}
C.__index = C

M.MAX_ITEMS = 64 -- the protocol's limit on `context`

function M.new(cfg)
  return setmetatable({ cfg = cfg, ring = {}, version = 0, built = nil }, C)
end

function C:enabled()
  return self.cfg.context.enabled and self.cfg.context.max_chunks > 0
end

local function blank(s) return not s:find('%S') end

-- At most `max_chars` of `s`, cut at a line end when there is one.
local function cap(s, max_chars)
  if #s <= max_chars then return s end
  local cut = s:sub(1, max_chars)
  local nl = cut:match('.*()\n')
  return nl and cut:sub(1, nl - 1) or cut
end

--- The chunk of `buf` around lines [first, last) (0-based, end exclusive):
--- those lines, widened or narrowed to chunk_lines around their middle.
function C:chunk(buf, first, last, kind)
  local cc = self.cfg.context
  local n = api.nvim_buf_line_count(buf)
  local mid = math.floor((first + last) / 2)
  first = math.max(0, mid - math.floor(cc.chunk_lines / 2))
  last = math.min(n, first + cc.chunk_lines)
  local body = cap(table.concat(api.nvim_buf_get_lines(buf, first, last, false), '\n'),
    math.max(1, math.floor(cc.max_chars / 2)))
  return { buf = buf, uri = text.uri(buf), first = first, last = last, text = body, kind = kind or '' }
end

local function overlaps(a, b)
  return a.buf == b.buf and a.first < b.last and b.first < a.last
end

--- Put the chunk of `buf` around lines [first, last) into the ring (newest
--- first). An identical chunk keeps its place, so revisiting a spot does not
--- reorder the list; an older chunk of the same place is replaced.
function C:pick(buf, first, last, kind)
  if not self:enabled() or not api.nvim_buf_is_loaded(buf) or privacy.blocked(buf, self.cfg) then return end
  local chunk = self:chunk(buf, first, last, kind)
  if blank(chunk.text) then return end
  for _, c in ipairs(self.ring) do
    if c.uri == chunk.uri and c.text == chunk.text then return end
  end
  for i = #self.ring, 1, -1 do
    if overlaps(self.ring[i], chunk) then table.remove(self.ring, i) end
  end
  table.insert(self.ring, 1, chunk)
  while #self.ring > self.cfg.context.max_chunks do table.remove(self.ring) end
  self:changed()
end

--- The lines around the cursor of `buf`'s window, or of its last position.
function C:pick_cursor(buf)
  local row
  if api.nvim_get_current_buf() == buf then
    row = api.nvim_win_get_cursor(0)[1] - 1
  else
    row = api.nvim_buf_get_mark(buf, '"')[1] - 1
  end
  row = math.max(0, row)
  self:pick(buf, row, row + 1, 'visited')
end

--- The range the last change or yank touched ('[ and '] marks); `kind`: 'edit' or 'yank'.
function C:pick_changed(buf, kind)
  local s, e = api.nvim_buf_get_mark(buf, '['), api.nvim_buf_get_mark(buf, ']')
  if s[1] == 0 or e[1] == 0 then return end
  self:pick(buf, s[1] - 1, math.max(s[1], e[1]), kind)
end

--- Something the list depends on changed: the next request rebuilds it.
function C:changed()
  self.version = self.version + 1
  self.built = nil
end

-- Other loaded, listed buffers of `ft`, most recently used first.
local function same_filetype(buf, ft)
  local out = {}
  for _, info in ipairs(vim.fn.getbufinfo({ buflisted = 1, bufloaded = 1 })) do
    local b = info.bufnr
    if b ~= buf and vim.bo[b].filetype == ft then out[#out + 1] = { buf = b, used = info.lastused or 0 } end
  end
  table.sort(out, function(x, y)
    if x.used ~= y.used then return x.used > y.used end
    return x.buf > y.buf
  end)
  return out
end

--- The `context` of a request in `buf` whose document holds lines [first,
--- last): the ring's chunks (less those of this buffer inside that window,
--- which the server gets anyway), then other buffers of the same filetype;
--- within max_chunks and max_chars. The same list until something changes.
function C:items(buf, first, last)
  if not self:enabled() then return {} end
  local key = table.concat({ buf, first, last, self.version, vim.bo[buf].filetype }, ':')
  if self.built and self.built.key == key then return self.built.items end
  local cc = self.cfg.context
  local window = { buf = buf, first = first, last = last }
  local chosen, items, size = {}, {}, 0
  local max_items = math.min(cc.max_chunks, M.MAX_ITEMS)
  local function add(c)
    if #items >= max_items or size + #c.text > cc.max_chars then return end
    if not api.nvim_buf_is_valid(c.buf) or privacy.blocked(c.buf, self.cfg) then return end
    if overlaps(c, window) then return end
    for _, other in ipairs(chosen) do
      if overlaps(c, other) then return end
    end
    chosen[#chosen + 1] = c
    items[#items + 1] = { uri = c.uri, text = c.text, kind = c.kind }
    size = size + #c.text
  end
  for _, c in ipairs(self.ring) do add(c) end
  if cc.buffers > 0 then
    for i, b in ipairs(same_filetype(buf, vim.bo[buf].filetype)) do
      if i > cc.buffers then break end
      if not privacy.blocked(b.buf, self.cfg) then
        local row = math.max(0, api.nvim_buf_get_mark(b.buf, '"')[1] - 1)
        local c = self:chunk(b.buf, row, row + 1, 'open')
        if not blank(c.text) then add(c) end
      end
    end
  end
  self.built = { key = key, items = items }
  return items
end

return M
