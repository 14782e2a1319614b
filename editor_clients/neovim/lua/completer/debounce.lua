-- How long to wait after a keystroke before asking for a completion, when
-- debounce_ms is not fixed. A warm keystroke costs the server a few tokens
-- and a superseded request is cancelled at once (its prefill reused by the
-- next), so the plugin asks at once, as llama.vim does, and waits only when
-- the server says so: its last `done` carried `hold_ms` (server.client_hold:
-- other editors share a loaded engine), followed for HOLD_FRESH_MS. Clamped
-- to [min_ms, max_ms]. The VS Code client's debounce.ts is the same rule.
local M = {}
local D = {}
D.__index = D

local HOLD_FRESH_MS = 3000

function M.new(min_ms, max_ms)
  return setmetatable({ min_ms = min_ms, max_ms = max_ms }, D)
end

--- The server's `done.hold_ms`, received at `now_ms`.
function D:hold(ms, now_ms)
  self.hold_ms, self.hold_at = ms, now_ms
end

--- The wait before the next request at `now_ms`, in ms.
function D:delay(now_ms)
  local lo = math.max(0, math.min(self.min_ms, self.max_ms))
  local hi = math.max(lo, self.max_ms)
  local wanted = 0
  if self.hold_ms and now_ms - self.hold_at <= HOLD_FRESH_MS then wanted = self.hold_ms end
  return math.floor(math.min(hi, math.max(lo, wanted)) + 0.5)
end

function D:state(now_ms)
  return { hold_ms = self.hold_ms, delay_ms = self:delay(now_ms) }
end

return M
