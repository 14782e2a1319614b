-- completer for Neovim: ask `completer serve` for a completion after a pause
-- in insert-mode typing, stream it in as ghost text, accept all of it, a word
-- or a line, and tell the server what was kept (feedback).
local config = require('completer.config')
local ghost = require('completer.ghost')
local text = require('completer.text')
local Client = require('completer.client')
local api, uv = vim.api, vim.loop

local M = {}

local S = {
  cfg = nil, client = nil, enabled = false, timer = nil,
  req = nil, -- the request whose completion is (or will be) shown
  requests = {}, -- id -> request, until its done/error
  next_id = 0, last_key_ns = nil, pending_key = nil, pending_key_ns = nil,
  results = {}, latency = {}, counts = { sent = 0, shown = 0, accepted = 0, dismissed = 0 },
}

local function now() return uv.hrtime() end

local function cursor_state()
  local buf = api.nvim_get_current_buf()
  local pos = api.nvim_win_get_cursor(0)
  local row, col = pos[1] - 1, pos[2]
  return buf, row, col, ('%d:%d:%d:%d'):format(buf, row, col, api.nvim_buf_get_changedtick(buf))
end

local function in_insert() return vim.fn.mode():sub(1, 1) == 'i' end

local function remaining(req) return req.text:sub(req.consumed + 1) end

local function allowed(buf)
  if vim.bo[buf].buftype ~= '' or not vim.bo[buf].modifiable then return false end
  local ft = S.cfg.filetypes[vim.bo[buf].filetype]
  if ft == nil then ft = S.cfg.filetypes['*'] end
  return ft ~= false
end

-- Feedback goes out once per shown completion, after its `done` (the server
-- only counts completions it has finished).
local function feedback(req, accepted)
  if not req.t_shown or req.feedback_sent then return end
  if req.done then
    req.feedback_sent = true
    S.client:send({ type = 'feedback', id = req.id, accepted_chars = accepted })
  else
    req.feedback_pending = accepted
  end
end

local function cancel(req)
  if not req.done and not req.cancel_sent then
    req.cancel_sent = true
    S.client:send({ type = 'cancel', id = req.id })
  end
end

--- Hide the ghost text, cancel its request if still running, report feedback.
function M.dismiss()
  local req = S.req
  S.req = nil
  ghost.clear()
  if req then
    if req.t_shown and req.accepted == 0 then S.counts.dismissed = S.counts.dismissed + 1 end
    cancel(req)
    feedback(req, req.accepted)
  end
end

local function render(req)
  local buf, row, col, key = cursor_state()
  if key ~= req.key or not in_insert() then return end
  local rest = remaining(req)
  if rest == '' then return ghost.clear() end
  if ghost.show(buf, row, col, rest, S.cfg.hl_group) and not req.t_shown then
    req.t_shown = now()
    S.counts.shown = S.counts.shown + 1
  end
end

local function trigger()
  if not S.enabled or not in_insert() then return end
  local buf, row, col, key = cursor_state()
  if key ~= S.pending_key or not allowed(buf) then return end
  if not S.client:is_open() then return S.client:ensure() end
  S.next_id = S.next_id + 1
  local req = { id = tostring(S.next_id), key = key, text = '', deltas = {}, consumed = 0, accepted = 0,
    t_key = S.pending_key_ns, t_trigger = now() }
  local doc = text.document(buf, row, col, S.cfg.max_lines)
  local c = S.cfg
  req.t_send = now() -- before the write: the server's ttft interval lies inside send..shown
  local ok = S.client:send({
    type = 'complete', id = req.id, document = doc, mode = text.mode(c.mode, doc.prefix),
    max_tokens = c.max_tokens, temperature = c.temperature, deadline_ms = c.deadline_ms,
    stop = (c.stop and #c.stop > 0) and c.stop or nil,
  })
  if not ok then return end
  S.counts.sent = S.counts.sent + 1
  S.requests[req.id], S.req = req, req
end

-- Any edit or cursor move in insert mode: drop what is shown and start the
-- debounce again (a state already handled, e.g. after accept word, is kept).
local function on_edit(entering)
  if not S.enabled or not (entering or in_insert()) then return end
  local _, _, _, key = cursor_state()
  if (S.req and S.req.key == key) or S.pending_key == key then return end
  M.dismiss()
  S.pending_key, S.pending_key_ns, S.last_key_ns = key, S.last_key_ns or now(), nil
  S.timer:stop()
  uv.update_time() -- the loop's clock may be stale: the debounce counts from now
  S.timer:start(S.cfg.debounce_ms, 0, vim.schedule_wrap(trigger))
end

local function on_leave()
  S.timer:stop()
  S.pending_key = nil
  M.dismiss()
end

local function record_latency(req, msg)
  local t = type(msg.timings) == 'table' and msg.timings or nil
  if not (req.t_shown and t and t.ttft_ms) then return end
  local ms = function(a, b) return (a and b) and (b - a) / 1e6 or nil end
  table.insert(S.latency, {
    id = req.id, reason = msg.reason, ttft_ms = t.ttft_ms, server_total_ms = t.total_ms,
    debounce_ms = ms(req.t_key, req.t_trigger), key_to_shown_ms = ms(req.t_key, req.t_shown),
    send_to_shown_ms = ms(req.t_send, req.t_shown), send_to_first_recv_ms = ms(req.t_send, req.t_first_recv),
  })
  while #S.latency > S.cfg.latency_records do table.remove(S.latency, 1) end
end

local function on_message(msg, recv_ns)
  local req = type(msg.id) == 'string' and S.requests[msg.id] or nil
  if not req then return end
  if msg.type == 'delta' and type(msg.text) == 'string' then
    req.text = req.text .. msg.text
    req.deltas[#req.deltas + 1] = msg.text
    req.t_first_recv = req.t_first_recv or recv_ns
    if S.req == req then render(req) end
  elseif msg.type == 'done' or msg.type == 'error' then
    S.requests[msg.id] = nil
    req.done = msg
    if msg.type == 'done' and type(msg.text) == 'string' then
      req.text = msg.text
      record_latency(req, msg)
    end
    table.insert(S.results, { id = req.id, type = msg.type, text = msg.text, reason = msg.reason,
      code = msg.code, deltas = req.deltas, timings = msg.timings, shown = req.t_shown ~= nil,
      cancel_sent = req.cancel_sent == true })
    if #S.results > 50 then table.remove(S.results, 1) end
    if req.feedback_pending then feedback(req, req.feedback_pending) end
    if S.req == req then render(req) end
  end
end

local function on_disconnect()
  for id, req in pairs(S.requests) do
    req.done = { type = 'error', id = id, code = 'disconnected' }
  end
  S.requests = {}
end

local function accept(kind)
  local req = S.req
  if not req or remaining(req) == '' then return false end
  local rest = remaining(req)
  local piece = kind == 'word' and text.next_word(rest) or kind == 'line' and text.next_line(rest) or rest
  local buf, row, col = cursor_state()
  ghost.clear()
  text.insert(buf, row, col, piece)
  req.consumed = req.consumed + #piece
  req.accepted = req.accepted + text.chars(piece)
  S.counts.accepted = S.counts.accepted + 1
  if kind == 'all' or (req.done and remaining(req) == '') then
    S.req = nil
    cancel(req)
    feedback(req, req.accepted)
  else
    local _, _, _, key = cursor_state()
    req.key = key
    render(req)
  end
  return true
end

--- Insert the whole completion shown (true), or nothing when none is (false).
function M.accept() return accept('all') end
function M.accept_word() return accept('word') end
function M.accept_line() return accept('line') end

--- True when ghost text is shown.
function M.visible() return S.req ~= nil and ghost.text() ~= nil end

-- Each key does its action while ghost text is shown, else what it does
-- without the plugin (the expr mapping returns the key itself, not remapped).
local function map_keys()
  for _, lhs in ipairs(S.mapped or {}) do pcall(vim.keymap.del, 'i', lhs) end
  S.mapped = {}
  for _, name in ipairs({ 'accept', 'accept_word', 'accept_line', 'dismiss' }) do
    local lhs = S.cfg.keymaps[name]
    if lhs then
      vim.keymap.set('i', lhs, function()
        if M.visible() then return ('<Cmd>lua require("completer").%s()<CR>'):format(name) end
        return lhs
      end, { expr = true, silent = true, desc = 'completer: ' .. name })
      table.insert(S.mapped, lhs)
    end
  end
end

function M.enable()
  if not S.cfg then return M.setup({ enabled = true }) end
  S.enabled = true
  S.client:start()
end

function M.disable()
  if not S.cfg then return end
  S.enabled = false
  on_leave()
end

function M.toggle()
  if not S.cfg then
    M.setup({})
    return S.enabled
  end
  if S.enabled then M.disable() else M.enable() end
  return S.enabled
end

function M.is_enabled() return S.enabled end

--- Connection and counters, as a table (:CompleterStatus prints it).
function M.status()
  if not S.client then return { state = 'not set up' } end
  local st = S.client:status()
  st.enabled, st.counts = S.enabled, vim.deepcopy(S.counts)
  local n = #S.latency
  st.last_latency = n > 0 and S.latency[n] or nil
  return st
end

--- The last finished request: id, type, text (done.text), reason, deltas, timings.
function M.last_result() return S.results[#S.results] end
--- The last 50 finished requests, oldest first.
function M.results() return S.results end
--- The request shown now: id, text so far, consumed (bytes accepted), done; nil if none.
function M.current()
  local r = S.req
  return r and { id = r.id, text = r.text, consumed = r.consumed, done = r.done ~= nil, shown = r.t_shown ~= nil }
end
--- The completion text shown now (nil when none).
function M.ghost_text() return ghost.text() end
--- Per-request timings (ms): ttft_ms (server), debounce_ms, key_to_shown_ms, send_to_shown_ms.
function M.latency() return S.latency end
function M.clear_latency() S.latency = {} end

function M.setup(opts)
  local cfg = config.build(opts) -- raises on a bad option, before anything changes
  if S.client then S.client:stop() end
  S.cfg = cfg
  S.timer = S.timer or uv.new_timer()
  S.client = Client.new(S.cfg, { on_message = on_message, on_disconnect = on_disconnect })
  vim.cmd('highlight default link ' .. S.cfg.hl_group .. ' Comment')
  local group = api.nvim_create_augroup('completer', { clear = true })
  local au = function(events, fn) api.nvim_create_autocmd(events, { group = group, callback = function() fn() end }) end
  au('InsertEnter', function() on_edit(true) end)
  au({ 'TextChangedI', 'TextChangedP', 'CursorMovedI' }, on_edit)
  au({ 'InsertLeave', 'BufLeave' }, on_leave)
  au('VimLeavePre', function() S.client:stop() end)
  au('ColorScheme', function() vim.cmd('highlight default link ' .. S.cfg.hl_group .. ' Comment') end)
  vim.on_key(function() S.last_key_ns = now() end, ghost.ns)
  map_keys()
  if S.cfg.enabled then M.enable() else S.enabled = false end
end

M._state = S
return M
