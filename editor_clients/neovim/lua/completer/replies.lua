-- What the server sends back (delta, done, error), the end of a connection,
-- and requests given up past their deadline.
local core = require('completer.core')
local ghost = require('completer.ghost')
local indicator = require('completer.indicator')
local uv = vim.loop

local M = {}
local S = core.S

local function record_latency(req, msg)
  local t = type(msg.timings) == 'table' and msg.timings or nil
  if t and req.kind ~= 'prime' and type(t.prompt_tokens) == 'number' and type(t.cached_tokens) == 'number' then
    -- How much of the prompts the server found cached: what a stable
    -- window and context are for (:CompleterStatus shows the share).
    S.counts.prompt_tokens = S.counts.prompt_tokens + t.prompt_tokens
    S.counts.cached_tokens = S.counts.cached_tokens + t.cached_tokens
  end
  if type(msg.hold_ms) == 'number' then S.debounce:hold(msg.hold_ms, core.now() / 1e6) end -- the server's load
  -- Per-request timings are those of requests sent for a keystroke; one
  -- served later (a speculative answer) was sent before its keystroke.
  if not (req.t_shown and t and t.ttft_ms and req.kind == 'complete' and req.t_key and not req.served) then return end
  local ms = core.ms
  table.insert(S.latency, {
    id = req.id, reason = msg.reason, ttft_ms = t.ttft_ms, server_total_ms = t.total_ms,
    debounce_ms = ms(req.t_key, req.t_trigger), key_to_shown_ms = ms(req.t_key, req.t_shown),
    send_to_shown_ms = ms(req.t_send, req.t_shown), send_to_first_recv_ms = ms(req.t_send, req.t_first_recv),
  })
  while #S.latency > S.cfg.latency_records do table.remove(S.latency, 1) end
end

local function ended(req, msg)
  S.requests[req.id] = nil
  req.done = msg
  table.insert(S.results, { id = req.id, kind = req.kind, type = msg.type, text = msg.text, reason = msg.reason,
    code = msg.code, deltas = req.deltas, timings = msg.timings, shown = req.t_shown ~= nil, n = req.n,
    candidates = type(msg.candidates) == 'table' and msg.candidates or nil,
    cancel_sent = req.cancel_sent == true })
  if #S.results > 50 then table.remove(S.results, 1) end
  if S.spec == req and msg.type ~= 'done' then S.spec = nil end
end

function M.on_message(msg, recv_ns)
  local req = type(msg.id) == 'string' and S.requests[msg.id] or nil
  if not req then return end
  if msg.type == 'delta' and type(msg.text) == 'string' then
    req.text = req.text .. msg.text
    req.deltas[#req.deltas + 1] = msg.text
    req.t_first_recv = req.t_first_recv or recv_ns
    if S.req == req then core.refresh() end
  elseif msg.type == 'done' or msg.type == 'error' then
    ended(req, msg)
    if msg.type == 'error' and req.kind == 'prime' and msg.code == 'bad_request' then
      S.prime_unsupported = true -- a server older than max_tokens 0: stop asking
    end
    if msg.type == 'done' and type(msg.text) == 'string' then
      req.text = msg.text
      record_latency(req, msg)
      if msg.reason ~= 'cancelled' and (req.kind == 'complete' or req.kind == 'spec') then
        S.cache:put(req.key, msg.text, req)
      end
    end
    if req.n then require('completer.cycle').on_done(req, msg) end -- asked with candidates: the cycle's texts
    if S.req == req then core.refresh() end
    -- (A cycle's request is finished with the completion it was asked for.)
    if req.finish_pending or (S.req ~= req and S.spec ~= req and not req.parent) then core.finish(req) end
    indicator.update()
  end
end

function M.on_disconnect()
  for id, req in pairs(S.requests) do
    ended(req, { type = 'error', id = id, code = 'disconnected' })
    if S.req == req then
      S.req = nil
      ghost.clear()
    end
  end
  S.requests, S.spec, S.primed = {}, nil, {}
  S.prime_unsupported = nil -- the next server may be newer
  indicator.update()
end

-- Requests past their deadline plus a margin are given up: the server should
-- have ended them, so the connection is suspect and gets a ping.
function M.check_timeouts()
  local t = core.now()
  for _, req in pairs(S.requests) do
    if t >= req.timeout_at then
      S.counts.timeouts = S.counts.timeouts + 1
      core.cancel(req)
      ended(req, { type = 'error', id = req.id, code = 'timeout' })
      if S.req == req then
        S.req = nil
        ghost.clear()
      end
      S.client:probe()
    end
  end
  indicator.update()
  if next(S.requests) == nil and S.timeout_timer then S.timeout_timer:stop() end
end

function M.watch_timeouts()
  S.timeout_timer = S.timeout_timer or uv.new_timer()
  if not S.timeout_timer:is_active() then
    S.timeout_timer:start(200, 200, vim.schedule_wrap(M.check_timeouts))
  end
end

return M
