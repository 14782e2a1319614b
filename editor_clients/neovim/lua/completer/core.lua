-- The life of a completion: asked for after a pause in typing (or served at
-- once from the cache), streamed in as ghost text, typed through, accepted
-- whole, by word or by line, dismissed, and reported back (`feedback`).
-- init.lua wires these to autocommands; accept.lua holds the accept keys,
-- replies.lua what the server sends back. (Past ~300 lines: the states of
-- one suggestion, asked, shown, typed through, accepted, read as one story.)
local ghost = require('completer.ghost')
local indicator = require('completer.indicator')
local text = require('completer.text')
local privacy = require('completer.privacy')
local api, uv = vim.api, vim.loop

local M = {}

-- Set up by init.setup(): cfg, client, timer, debounce, cache, context.
local S = {
  cfg = nil, client = nil, enabled = false,
  req = nil, -- the completion shown (or to be shown when it streams in)
  requests = {}, -- id -> request, until its done/error
  spec = nil, -- the speculative "next line" request, until adopted or replaced
  accepting = nil, -- the piece an accept key is inserting
  next_id = 0, last_key_ns = nil, pending_key = nil, pending_key_ns = nil, last_edit_key = nil,
  results = {}, latency = {}, shows = {},
  counts = { sent = 0, shown = 0, accepted = 0, dismissed = 0, typed = 0, cache_hits = 0, primed = 0,
    speculative = 0, timeouts = 0, prompt_tokens = 0, cached_tokens = 0 },
  primed = {}, -- buf -> the state last primed
  snooze_until = nil, -- wall-clock ms until which no request is automatic (:CompleterSnooze)
}
M.S = S

local function now() return uv.hrtime() end
local function ms(a, b) return (a and b) and (b - a) / 1e6 or nil end

function M.in_insert() return vim.fn.mode():sub(1, 1) == 'i' end

local function snapshot()
  local buf = api.nvim_get_current_buf()
  local pos = api.nvim_win_get_cursor(0)
  return text.snapshot(buf, pos[1] - 1, pos[2])
end
M.snapshot = snapshot

-- The exact state (buffer, cursor, change): autocommands that fire twice for
-- one change (TextChangedI, then CursorMovedI) are handled once.
function M.state_key(snap)
  return ('%d:%d:%d:%d'):format(snap.buf, snap.row, snap.col, snap.tick or -1)
end

function M.remaining(req) return req.text:sub(req.consumed + 1) end

function M.allowed(buf) return privacy.completes(buf, S.cfg) end

--- Wall-clock milliseconds (a snooze counts the time the machine slept).
function M.wall_ms()
  local s, us = uv.gettimeofday()
  return s * 1000 + us / 1000
end

--- Minutes left of a snooze (nil when not snoozed).
function M.snoozed()
  local t = S.snooze_until
  if t and M.wall_ms() < t then return (t - M.wall_ms()) / 60000 end
  S.snooze_until = nil
end

--- True when completions are asked for without being asked: trigger
--- 'auto' and not snoozed. Otherwise only :CompleterSuggest (or its key)
--- and the cycle keys ask; nothing is primed or asked for ahead either.
function M.automatic()
  return S.cfg.trigger ~= 'manual' and not M.snoozed()
end

-- Ask a completion plugin's `fn` (a function of the module, if it has it)
-- whether its menu is open; any failure is "no".
local function asks(mod, fn)
  if type(mod) == 'table' and type(mod[fn]) == 'function' then
    local ok, v = pcall(mod[fn])
    return ok and v == true
  end
  return false
end

--- True while a popup menu is open (the built-in one, nvim-cmp's or
--- blink.cmp's): ghost text would fight it for the same keys and the same
--- space. The plugins are looked at only if loaded (never loaded from here).
function M.pum_open()
  if vim.fn.pumvisible() == 1 then return true end
  if asks(package.loaded.cmp, 'visible') then return true end
  local blink = package.loaded['blink.cmp']
  -- is_menu_visible (newer blink.cmp) is the menu alone; is_visible also
  -- counts its own ghost text, which is as much in the way.
  return asks(blink, 'is_menu_visible') or asks(blink, 'is_visible')
end

-- Whether `req` still applies at `snap`: the user has only typed (or
-- accepted) text it begins with since it was asked for. Updates how much of
-- it is consumed; false when the state has moved elsewhere.
function M.follow(req, snap)
  local typed = text.typed_since(req.origin, snap)
  if not typed then return false end
  local at = req.base + #typed
  if req.text:sub(req.base + 1, at) ~= typed then return false end
  -- Without type-through only an accept (which moves `consumed` first) may advance.
  if at ~= req.consumed and not S.cfg.type_through then return false end
  req.consumed = at
  return true
end

-- Keystroke to ghost text, for every completion drawn and every keystroke
-- typed through one (its rest is drawn in that keystroke's own tick).
local function note_show(source, t_key, t_shown)
  if not t_key then return end
  table.insert(S.shows, { source = source, ms = ms(t_key, t_shown) })
  while #S.shows > S.cfg.latency_records do table.remove(S.shows, 1) end
end

function M.render(req, snap)
  if S.req ~= req or not M.in_insert() then return end
  if S.cfg.hide_during_pum and M.pum_open() then return ghost.clear() end
  local rest = M.remaining(req)
  if rest == '' then return ghost.clear() end
  local c = req.cycle
  local counter = c and c.alts and (' %d/%d'):format(c.i, #c.alts) or nil -- candidate i of N
  if ghost.show(snap.buf, snap.row, snap.col, rest, S.cfg.hl_group, counter) and not req.t_shown then
    req.t_shown = now()
    if req.kind ~= 'cache' then S.counts.shown = S.counts.shown + 1 end
    note_show(req.kind, req.t_key, req.t_shown)
  end
end

--- Re-draw what is shown, if it still applies where the cursor is.
function M.refresh()
  local req = S.req
  if not req then return ghost.clear() end
  local snap = snapshot()
  if M.follow(req, snap) then M.render(req, snap) else M.dismiss() end
end

function M.cancel(req)
  if not req.done and not req.cancel_sent then
    req.cancel_sent = true
    S.client:send({ type = 'cancel', id = req.id })
  end
end

-- The feedback owed for `req`, sent once its `done` is in (the server only
-- counts finished completions): how much was accepted with the keys, how
-- much typed through, and whether it was ever drawn.
function M.finish(req)
  -- (First: a completion from the cache owes no feedback, its cycle's request does.)
  if req.cycle then require('completer.cycle').settle(req) end
  if req.finished or req.kind == 'prime' or req.kind == 'cache' then return end
  if not req.done then
    req.finish_pending = true
    return
  end
  req.finished = true
  if req.done.type ~= 'done' or (req.done.text or '') == '' then return end
  local kept = text.chars(req.text:sub(1, req.consumed))
  local typed = math.max(0, kept - req.accepted)
  if req.t_shown then
    S.counts.typed = S.counts.typed + typed
    if req.accepted == 0 and typed == 0 then S.counts.dismissed = S.counts.dismissed + 1 end
  end
  S.client:send({ type = 'feedback', id = req.id, accepted_chars = req.accepted, typed_chars = typed,
    shown = req.t_shown ~= nil, candidate = req.candidate }) -- (candidate: which of an `n` request's texts)
end

--- Hide the ghost text, cancel its request if still running, report feedback.
function M.dismiss()
  local req = S.req
  S.req = nil
  ghost.clear()
  if req then
    M.cancel(req)
    M.finish(req)
  end
  indicator.update()
end

local function new_request(kind, snap)
  local id
  if kind == 'cache' then -- never sent: an id of its own kind, not one of the server's
    S.cache_seq = (S.cache_seq or 0) + 1
    id = 'cache:' .. S.cache_seq
  else
    S.next_id = S.next_id + 1
    id = tostring(S.next_id)
  end
  return { id = id, kind = kind, origin = snap, key = text.key(snap), text = '', deltas = {},
    base = 0, consumed = 0, accepted = 0 }
end

-- Ask the server. `kind`: 'complete' (shown), 'prime' (max_tokens 0: warm
-- the server's cache, nothing comes back), 'spec' (a speculative request for
-- the line Enter would open, kept for the cache). `doc_snap` is where the
-- cursor is now; `snap` the state the completion is for (differs for 'spec').
--- A request's `context`: the chunks picked, then the definitions of what
--- the document imports (resolved in the background; never waited for).
function M.context(buf, first, last)
  local items = S.context:items(buf, first, last)
  local defs = S.definitions:items(buf)
  if #defs == 0 then return items end
  local out, size = {}, 0
  for _, c in ipairs(items) do
    out[#out + 1] = c
    size = size + #c.text
  end
  local limit = math.min(S.cfg.context.max_chunks + #defs, 64) -- the protocol's limit
  for _, d in ipairs(defs) do
    if #out >= limit or size + #d.text > 2 * S.cfg.context.max_chars then break end
    out[#out + 1] = d
    size = size + #d.text
  end
  return out
end

--- The server's default deadline (its `ready`'s request.deadline_ms), which a
--- request without deadline_ms gets; nil when not connected or not said.
function M.server_deadline_ms()
  local server = S.client and S.client.server
  local d = type(server) == 'table' and type(server.request) == 'table' and server.request.deadline_ms
  if type(d) == 'number' and d > 0 and d < math.huge then return d end
end

--- How long a request for `uri` is waited for before it is given up (ms):
--- `request_timeout_ms` if set, else its deadline plus the margin. The
--- deadline: `deadline_ms`, else the server's default (its ready's
--- request.deadline_ms, 2 s if it says none), or for the document's first
--- request on this connection its first deadline (request.first_deadline_ms,
--- 15 s if it says none), which covers a cold prefill of the whole document.
function M.wait_ms(uri)
  local c = S.cfg
  if c.request_timeout_ms and c.request_timeout_ms > 0 then return c.request_timeout_ms end
  local seen = S.sent_for
  if not seen or seen.client ~= S.client or seen.conn ~= S.client.connects then
    seen = { client = S.client, conn = S.client.connects, uris = {} } -- a new connection: its server knows no document
    S.sent_for = seen
  end
  local first = not seen.uris[uri]
  seen.uris[uri] = true
  local deadline = c.deadline_ms
  if not deadline then
    deadline = M.server_deadline_ms() or 2000
    if first then
      local server = S.client.server
      local f = type(server) == 'table' and type(server.request) == 'table' and server.request.first_deadline_ms
      deadline = math.max(deadline, (type(f) == 'number' and f > 0 and f < math.huge) and f or 15000)
    end
  end
  return deadline + c.request_timeout_margin_ms
end

--- `asked`: the user asked for this one (:CompleterSuggest, cycling): the
--- server shows something even where its first token is unsure.
local function send(kind, doc_snap, snap, extra_prefix, n, asked)
  local c = S.cfg
  local req = new_request(kind, snap)
  local doc, first, last = text.document(doc_snap.buf, doc_snap.row, doc_snap.col, c.max_lines)
  if extra_prefix then doc.prefix = doc.prefix .. extra_prefix end
  local context = M.context(doc_snap.buf, first, last)
  local msg = {
    type = 'complete', id = req.id, document = doc, mode = text.mode(c.mode, snap.before, snap.after),
    max_tokens = c.max_tokens, temperature = c.temperature, deadline_ms = c.deadline_ms,
    stop = (c.stop and #c.stop > 0) and c.stop or nil, context = #context > 0 and context or nil,
    workspace = S.definitions.workspace(doc_snap.buf),
    n = (n and n > 1) and n or nil,
    min_first_prob = asked and 0 or nil,
  }
  req.uri, req.n = doc.uri, msg.n
  if kind == 'prime' then
    msg.max_tokens = 0
  elseif kind == 'spec' or kind == 'cycle' then
    msg.supersede = false -- the request for where the cursor is goes on
  else
    for _, r in pairs(S.requests) do
      -- A prime still prefilling this document: let it finish (its prompt
      -- is this request's) rather than end it.
      if r.kind == 'prime' and r.uri == doc.uri then msg.supersede = false end
    end
  end
  req.t_send = now() -- before the write: the server's ttft interval lies inside send..shown
  -- Past its deadline plus a margin a request is given up, and the connection probed.
  req.timeout_at = req.t_send + M.wait_ms(doc.uri) * 1e6
  if not S.client:send(msg) then return nil end
  S.requests[req.id] = req
  require('completer.replies').watch_timeouts() -- (replies requires this module)
  return req
end

M.send = send

--- Send a completion request for where the cursor is now (no debounce);
--- `n` > 1 asks for that many candidates to cycle through; `asked`: the user
--- asked for it.
function M.request_now(snap, t_key, n, asked)
  local req = send('complete', snap, snap, nil, n, asked)
  if not req then return end
  S.counts.sent = S.counts.sent + 1
  req.t_key, req.t_trigger = t_key, now()
  S.req = req
  indicator.update()
  return req
end

-- The debounce ran out: ask, unless the state moved on meanwhile.
function M.trigger()
  local pending = S.pending_key
  S.pending_key = nil
  if not S.enabled or not M.in_insert() or not M.automatic() then return end
  local snap = snapshot()
  if M.state_key(snap) ~= pending or not M.allowed(snap.buf) then return end
  if not S.client:is_open() then return S.client:ensure() end
  M.request_now(snap, S.pending_key_ns)
end

-- After a whole completion is accepted at the end of a line, the next thing
-- typed is likely Enter: ask now for the line it would open, without ending
-- the request for where the cursor is (supersede false, so it is sent after
-- that one), and keep the answer in the cache, where Enter finds it.
function M.speculate(snap)
  if not S.cfg.speculative or S.cfg.cache_size <= 0 or snap.after ~= '' or not S.client:is_open()
    or not M.automatic() then return end
  local next_snap = text.after_enter(snap)
  if S.cache:peek(text.key(next_snap)) then return end
  M.drop_spec()
  local req = send('spec', snap, next_snap, '\n' .. next_snap.indent)
  if req then
    S.counts.speculative = S.counts.speculative + 1
    S.spec = req
  end
end

--- Give up the speculative request: cancelled if running, reported as never
--- shown (its answer stays in the cache, served without feedback).
function M.drop_spec()
  local spec = S.spec
  S.spec = nil
  if spec then
    M.cancel(spec)
    M.finish(spec)
  end
end

-- Show a completion for `snap` without asking the server: from the cache, or
-- the speculative request if it was for here. True when one is shown.
function M.serve(snap, t_key)
  local e, back = S.cache:lookup(snap)
  if e then
    local r = e.req
    if r and not r.finished and S.req ~= r then
      -- Its feedback is still owed (a speculative answer, say): show that
      -- request again, so what is kept of it is reported.
      if S.spec == r then S.spec = nil end
      r.origin, r.base, r.consumed, r.kind, r.served = snap, back, back, 'complete', true
    else
      r = new_request('cache', snap)
      r.text, r.done = e.text:sub(back + 1), { type = 'done', text = e.text }
    end
    r.t_key = t_key
    S.counts.cache_hits = S.counts.cache_hits + 1
    S.req = r
    M.render(r, snap)
    return true
  end
  local spec = S.spec
  if spec and not spec.done and spec.key == text.key(snap) then -- still streaming, for here
    S.spec = nil
    spec.kind, spec.served, spec.t_key, spec.t_trigger = 'complete', true, t_key, now()
    S.req = spec
    indicator.update()
    M.render(spec, snap)
    return true
  end
  return false
end

--- Warm the server's cache for where the cursor of `buf` is (a buffer just
--- opened or entered): a request with max_tokens 0, whose prompt (the same
--- document and context the next completion will send) the server keeps.
function M.prime(buf)
  if not (S.enabled and S.cfg.prime and S.client and S.client:is_open()) or S.prime_unsupported
    or not M.automatic() then return end
  -- An unnamed buffer has nothing worth warming yet (and no file to return to).
  if buf ~= api.nvim_get_current_buf() or api.nvim_buf_get_name(buf) == '' or not M.allowed(buf) then return end
  local snap = snapshot()
  local key = M.state_key(snap)
  if S.primed[buf] == key then return end
  if send('prime', snap, snap) then
    S.primed[buf] = key
    S.counts.primed = S.counts.primed + 1
  end
end

--- Any edit or cursor move in insert mode.
function M.on_edit(entering)
  if not S.enabled or not (entering or M.in_insert()) then return end
  local snap = snapshot()
  local skey = M.state_key(snap)
  if skey == S.last_edit_key then return end
  S.last_edit_key = skey
  local t_key = S.last_key_ns or now()
  S.last_key_ns = nil
  local req = S.req
  local was = req and req.consumed
  if req and M.follow(req, snap) then
    -- Typed (or accepted) what the completion begins with: keep showing the
    -- rest, no new request; a completion typed through to its end is over.
    if M.remaining(req) ~= '' or not req.done then
      S.timer:stop()
      S.pending_key = nil
      M.render(req, snap)
      if req.consumed > was and ghost.text() then note_show('type_through', t_key, now()) end
      return
    end
    S.req = nil
    ghost.clear()
    M.finish(req)
  elseif req then
    M.dismiss()
  end
  S.timer:stop()
  S.pending_key = nil
  -- (Manual or snoozed: not even the cache shows a suggestion unasked.)
  if not M.allowed(snap.buf) or not M.automatic() or M.serve(snap, t_key) then return end
  S.pending_key, S.pending_key_ns = skey, t_key
  local delay = S.cfg.debounce_ms or S.debounce:delay(t_key / 1e6)
  uv.update_time() -- the loop's clock may be stale: the debounce counts from now
  S.timer:start(delay, 0, vim.schedule_wrap(M.trigger))
end

function M.on_leave()
  if S.timer then S.timer:stop() end
  S.pending_key, S.last_edit_key = nil, nil
  M.dismiss()
  M.drop_spec()
end

--- True when ghost text is shown.
function M.visible() return S.req ~= nil and ghost.text() ~= nil end

M.now, M.ms = now, ms
return M
