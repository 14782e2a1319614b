-- Cycling through candidates (copilot.lua's <M-]> and <M-[>): other
-- completions for the same place, shown one at a time as "i/N".
--
-- They are asked for when the user first cycles, not with every request:
-- the server makes each candidate a row of its decode batch, so asking on
-- every keystroke (`n` > 1) would slow every completion down for the rare
-- one the user cycles through, and the server drops candidates when it is
-- busy anyway. Asked for on the first press, the request finds its prompt
-- in the server's cache (the completion shown was just asked for there), so
-- the candidates cost about one completion's decoding, once.
--
-- A cycle's first press sends a request with `n` for where the cursor is
-- (supersede false: the completion shown goes on); the completion shown
-- stays until its answer is in, then the next one appears. The texts are
-- the one shown (from where the cycle started) and the answer's text and
-- candidates, each once. Typing through one keeps those that begin with
-- what was typed. The feedback goes to the request whose text was kept,
-- with its index (`candidate`); the other is reported as shown, not kept.
local core = require('completer.core')

local M = {}
local S = core.S

-- The texts of a `done` as entries { text, id, candidate }: `done.text`
-- is candidate 0, `done.candidates[i]` candidate i.
local function entries(req, done)
  local out = { { text = done.text or '', id = req.id, candidate = 0 } }
  for i, t in ipairs(type(done.candidates) == 'table' and done.candidates or {}) do
    if type(t) == 'string' then out[#out + 1] = { text = t, id = req.id, candidate = i } end
  end
  return out
end

-- Entries not empty, each text once (the first kept).
local function unique(list)
  local out, seen = {}, {}
  for _, e in ipairs(list) do
    if e.text ~= '' and not seen[e.text] then
      seen[e.text] = true
      out[#out + 1] = e
    end
  end
  return out
end

-- Show entry `i` of the cycle of `req` (its text from the cycle's start).
local function switch(req, i)
  local c = req.cycle
  c.i = i
  req.text = req.text:sub(1, c.at) .. c.alts[i].text
  local snap = core.snapshot()
  if core.follow(req, snap) then core.render(req, snap) else core.dismiss() end
end

-- Typed (or accepted) since the cycle's start: only the entries that begin
-- with it still apply. The next of those after entry i in direction dir.
local function step(req, dir)
  local c = req.cycle
  local typed = req.text:sub(c.at + 1, req.consumed)
  local n = #c.alts
  for k = 1, n do
    local j = (c.i - 1 + dir * k) % n + 1
    if c.alts[j].text:sub(1, #typed) == typed and #c.alts[j].text > #typed then return j end
  end
end

--- The answer to a request with `n` is in: its texts become the cycle.
--- `req` is the cycle's own request ('cycle', for the completion shown), or
--- a completion asked for with `n` when nothing was shown.
function M.on_done(req, done)
  if done.type ~= 'done' then return end
  local shown = req.parent or req
  if S.req ~= shown or not shown.cycle or shown.cycle.alts then return end
  local c = shown.cycle
  local list = {}
  if req.parent then -- the completion shown first, as it was when the cycle began
    list[1] = { text = c.orig_text:sub(c.at + 1), id = shown.id, candidate = shown.candidate or 0 }
  end
  vim.list_extend(list, entries(req, done))
  c.alts = unique(list)
  if #c.alts == 0 then return end
  c.i = 1
  local j = req.parent and step(shown, c.dir or 1) or 1
  switch(shown, j or 1)
  if req.parent and c.alts[c.i].id == req.id then req.t_shown = req.t_shown or core.now() end
end

--- Show the next (dir 1) or previous (dir -1) candidate; the first press
--- asks for them. With nothing shown, ask for a completion with candidates
--- here (as copilot.lua does).
function M.cycle(dir)
  if not S.cfg or not S.enabled or not core.in_insert() then return end
  local snap = core.snapshot()
  if not core.allowed(snap.buf) then return end
  local req = S.req
  if req and not core.follow(req, snap) then
    core.dismiss()
    req = nil
  end
  local n = S.cfg.candidates
  if req and req.cycle and not req.done then return end -- asked with candidates already: on its way
  -- Still streaming: its text is not all there to cycle from; ask afresh.
  if not req or not req.done or core.remaining(req) == '' then
    if not S.client:is_open() then return S.client:ensure() end
    core.dismiss()
    S.timer:stop()
    S.pending_key = nil
    local r = core.request_now(snap, core.now(), n, true)
    if r and n > 1 then r.cycle = { at = 0, orig_text = '', dir = dir } end
    return
  end
  local c = req.cycle
  if c and c.alts then
    local j = step(req, dir)
    if j and j ~= c.i then
      switch(req, j)
      if c.req and c.alts[j].id == c.req.id then c.req.t_shown = c.req.t_shown or core.now() end
    end
    return
  end
  if c or n < 2 or not S.client:is_open() then return end -- (asked already: its answer is on the way)
  local creq = core.send('cycle', snap, snap, nil, n)
  if not creq then return end
  creq.parent = req
  req.cycle = { req = creq, at = req.consumed, accepted = req.accepted, orig_text = req.text, dir = dir }
  require('completer.indicator').update() -- generating the candidates
end

--- Before the feedback of `req` (the completion shown) is sent: settle
--- whose text was kept. The kept text's request gets what was kept since
--- the cycle began; the other gets what was kept before (nothing, usually:
--- shown, not kept).
function M.settle(req)
  local c = req.cycle
  req.cycle = nil
  if not c then return end
  local e = c.alts and c.alts[c.i]
  local creq = c.req
  if not creq then -- the request's own candidates
    if e then req.candidate = e.candidate end
    return
  end
  creq.parent = nil
  if e and e.id == creq.id then
    creq.text, creq.consumed = e.text, req.consumed - c.at
    creq.accepted, creq.candidate = req.accepted - c.accepted, e.candidate
    creq.t_shown = creq.t_shown or core.now()
    req.text, req.consumed, req.accepted = c.orig_text, c.at, c.accepted
  elseif creq.t_shown then
    -- Its candidates were shown, the user went back: shown, none kept.
    local first = c.alts and c.alts[2]
    creq.text, creq.consumed, creq.accepted = first and first.text or '', 0, 0
    creq.candidate = first and first.id == creq.id and first.candidate or nil
  end
  if not creq.done then core.cancel(creq) end
  core.finish(creq) -- (now, or when its done comes)
end

return M
