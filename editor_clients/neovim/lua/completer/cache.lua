-- Recent completions keyed by where the cursor stood when they were asked for
-- (text.key: the file, the lines around the cursor, the line split at it),
-- least recently used first out. Backspace-and-retype and coming back to a
-- spot find their completion here and send nothing; as in llama.vim, a key a
-- few characters back whose completion begins with what was typed since
-- serves the rest of it.
local text = require('completer.text')

local M = {}
local Cache = {}
Cache.__index = Cache

function M.new(size)
  return setmetatable({ size = size, map = {}, order = {}, hits = 0, misses = 0 }, Cache)
end

local function touch(self, key)
  for i, k in ipairs(self.order) do
    if k == key then
      table.remove(self.order, i)
      break
    end
  end
  table.insert(self.order, key)
end

--- Keep `value` (a completion's text) for `key`; `req` is the request it
--- came from, revived when the entry is served while its feedback is unsent.
function Cache:put(key, value, req)
  if self.size <= 0 or value == nil or value == '' then return end
  self.map[key] = { text = value, req = req }
  touch(self, key)
  while #self.order > self.size do
    self.map[table.remove(self.order, 1)] = nil
  end
end

--- The entry for exactly `key` ({ text, req }), or nil.
function Cache:peek(key)
  return self.map[key]
end

-- How far back (bytes before the cursor, on its line) a lookup tries.
local BACK = 64

--- The completion to show at `snap`: the one cached for it, or a cached one
--- asked for up to BACK bytes earlier on the line that starts with what was
--- typed since. Returns the entry ({ text, req }) and how many bytes of its
--- text were typed since (0: asked for exactly here); nil on a miss.
function Cache:lookup(snap)
  if self.size <= 0 then return nil end
  local before = snap.before
  for back = 0, math.min(BACK, #before) do
    local key = text.key(snap, before:sub(1, #before - back))
    local e = self.map[key]
    -- `back` may cut a UTF-8 sequence; then the comparison fails, as it should.
    if e and #e.text > back and (back == 0 or e.text:sub(1, back) == before:sub(#before - back + 1)) then
      self.hits = self.hits + 1
      touch(self, key)
      return e, back
    end
  end
  self.misses = self.misses + 1
  return nil
end

function Cache:clear()
  self.map, self.order = {}, {}
end

return M
