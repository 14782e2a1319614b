-- How long to wait after a keystroke before asking for a completion, when
-- debounce_ms is not fixed. A warm keystroke costs the server a few tokens
-- and a superseded request is cancelled at once, so the plugin asks at once
-- (as llama.vim does) and waits only when the server is busy or slow, never
-- for the user's typing rhythm alone:
--   busy: the server's last `done` said `hold_ms` (its requests wait for the
--     engine; server.client_hold), followed for HOLD_FRESH_MS;
--   slow: the server's recent first answers (the median of the last FIRSTS
--     sends to their first delta) take longer than the user's usual gap
--     between keys, so a request sent mid-burst is answered after the next
--     key anyway: then only a pause (GAP_FACTOR gaps) is asked about.
-- Clamped to [min_ms, max_ms]. The typing gap is an exponential moving
-- average; the first answers a median (one long prefill after a jump is not
-- the server being slow). The VS Code client's debounce.ts is the same rule.
local M = {}
local D = {}
D.__index = D

local PAUSE_MS = 1000 -- gaps longer than this are pauses, not the typing rhythm
local ALPHA = 0.3
local GAP_FACTOR = 1.5
local FIRSTS = 8
local HOLD_FRESH_MS = 3000

function M.new(min_ms, max_ms)
  return setmetatable({ min_ms = min_ms, max_ms = max_ms, firsts = {} }, D)
end

--- A keystroke at `now_ms`.
function D:keystroke(now_ms)
  if self.last then
    local gap = now_ms - self.last
    if gap > 0 and gap <= PAUSE_MS then
      self.gap = self.gap and (ALPHA * gap + (1 - ALPHA) * self.gap) or gap
    end
  end
  self.last = now_ms
end

--- A request's first answer (its first delta, or its done if none came), `ms` after it was sent.
function D:first_answer(ms)
  table.insert(self.firsts, ms)
  if #self.firsts > FIRSTS then table.remove(self.firsts, 1) end
end

--- The server's `done.hold_ms`, received at `now_ms`.
function D:hold(ms, now_ms)
  self.hold_ms, self.hold_at = ms, now_ms
end

local function median(xs)
  if #xs == 0 then return nil end
  local s = { unpack(xs) }
  table.sort(s)
  local n = #s
  return n % 2 == 1 and s[(n + 1) / 2] or (s[n / 2] + s[n / 2 + 1]) / 2
end

--- The wait before the next request at `now_ms`, in ms.
function D:delay(now_ms)
  local lo = math.max(0, math.min(self.min_ms, self.max_ms))
  local hi = math.max(lo, self.max_ms)
  local wanted = 0
  if self.hold_ms and now_ms and now_ms - self.hold_at <= HOLD_FRESH_MS then wanted = self.hold_ms end
  local first = median(self.firsts)
  if first and self.gap and first > self.gap then wanted = math.max(wanted, GAP_FACTOR * self.gap) end
  return math.floor(math.min(hi, math.max(lo, wanted)) + 0.5)
end

function D:state(now_ms)
  return { typing_gap_ms = self.gap, first_answer_ms = median(self.firsts), hold_ms = self.hold_ms,
    delay_ms = self:delay(now_ms) }
end

return M
