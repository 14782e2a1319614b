-- How long to wait after a keystroke before asking for a completion, when
-- debounce_ms is not fixed. A fast server makes requests cheap, so the wait
-- follows the recent latency: a completion the server answers in 20 ms is
-- asked for almost at once. A slow one makes every cancelled request costly,
-- so the wait grows with it, but never past 1.5 of the user's usual
-- keystroke gap (a burst of typing still sends nothing, and a pause is
-- answered as soon as it is one). Clamped to [min_ms, max_ms]; both averages
-- are exponential moving averages, as in the VS Code client's debounce.ts.
local M = {}
local D = {}
D.__index = D

local PAUSE_MS = 1000 -- gaps longer than this are pauses, not the typing rhythm
local ALPHA = 0.3
local GAP_FACTOR = 1.5

function M.new(min_ms, max_ms)
  return setmetatable({ min_ms = min_ms, max_ms = max_ms }, D)
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

--- A finished request's latency (sent to done), in ms.
function D:latency(ms)
  self.lat = self.lat and (ALPHA * ms + (1 - ALPHA) * self.lat) or ms
end

--- The wait before the next request, in ms.
function D:delay()
  local lo = math.max(0, math.min(self.min_ms, self.max_ms))
  local hi = math.max(lo, self.max_ms)
  if not self.lat then return math.floor((lo + hi) / 2) end
  local wanted = self.lat
  if self.gap then wanted = math.min(wanted, GAP_FACTOR * self.gap) end
  return math.floor(math.min(hi, math.max(lo, wanted)) + 0.5)
end

function D:state()
  return { typing_gap_ms = self.gap, latency_ms = self.lat, delay_ms = self:delay() }
end

return M
