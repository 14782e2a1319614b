-- completer for Neovim: ask `completer serve` for a completion after a pause
-- in insert-mode typing (or serve it from a cache of recent ones), stream it
-- in as ghost text, let typing consume it, accept all of it, a word or a
-- line, and tell the server what was kept (feedback). This file is the
-- public API and the wiring; core.lua holds a completion's life.
local config = require('completer.config')
local core = require('completer.core')
local ghost = require('completer.ghost')
local indicator = require('completer.indicator')
local keymaps = require('completer.keymaps')
local replies = require('completer.replies')
local privacy = require('completer.privacy')
local Client = require('completer.client')
local Cache = require('completer.cache')
local Context = require('completer.context')
local Definitions = require('completer.definitions')
local Debounce = require('completer.debounce')
local api, uv = vim.api, vim.loop

local M = {}
local S = core.S

M.dismiss = core.dismiss
M.visible = core.visible

-- Accept from Lua (a mapping of your own, :lua): the keys go through the
-- <Plug> mapping, so undo and `.` behave as with the default keys.
local function accept(kind)
  if not core.visible() then return false end
  api.nvim_feedkeys(api.nvim_replace_termcodes(keymaps.PLUG[kind], true, true, true), 'm', false)
  return true
end

--- Insert the whole completion shown (true), or nothing when none is (false).
function M.accept() return accept('accept') end
function M.accept_word() return accept('accept_word') end
function M.accept_line() return accept('accept_line') end

--- Ask for a completion here now, without the debounce (:CompleterSuggest,
--- keymaps.suggest; with trigger 'manual' the only way to get one).
function M.complete()
  if not S.cfg or not S.enabled or not core.in_insert() then return end
  if not S.client:is_open() then return S.client:ensure() end
  local snap = core.snapshot()
  if not core.allowed(snap.buf) then return end
  core.dismiss()
  S.timer:stop() -- the debounce would ask again for the same place
  S.pending_key = nil
  core.request_now(snap, uv.hrtime(), nil, true)
end

M.suggest = M.complete

--- Show the next candidate (the first time: ask for them); with nothing
--- shown, ask for a completion with candidates here.
function M.next() require('completer.cycle').cycle(1) end
--- Show the previous candidate.
function M.prev() require('completer.cycle').cycle(-1) end

--- No automatic completions for `minutes` (default 15; 0 ends a snooze).
--- Asking (:CompleterSuggest, the cycle keys) still works meanwhile.
function M.snooze(minutes)
  if not S.cfg then return end
  minutes = tonumber(minutes) or 15
  if minutes <= 0 then
    S.snooze_until = nil
    return
  end
  S.snooze_until = core.wall_ms() + minutes * 60000
  S.timer:stop()
  S.pending_key = nil
  core.dismiss()
  core.drop_spec()
end

--- Minutes of snooze left, or nil.
function M.snoozed() return S.cfg and core.snoozed() or nil end

function M.enable()
  if not S.cfg then return M.setup({ enabled = true }) end
  S.enabled = true
  S.client:start()
end

function M.disable()
  if not S.cfg then return end
  S.enabled = false
  core.on_leave()
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
  st.trigger, st.snoozed_min = S.cfg.trigger, core.snoozed()
  local n = #S.latency
  st.last_latency = n > 0 and S.latency[n] or nil
  st.debounce = S.debounce:state(core.now() / 1e6)
  st.cache = { entries = #S.cache.order, hits = S.cache.hits, misses = S.cache.misses }
  return st
end

--- A short word for a statusline: 'off', 'offline', 'excluded' (this
--- buffer is not sent), 'generating' (the server is generating the
--- completion asked for), 'snoozed 14m' (:CompleterSnooze, minutes left),
--- 'manual' (trigger 'manual') or 'ready'; with the prefix given (default
--- 'completer: ').
function M.statusline(prefix)
  prefix = prefix or 'completer: '
  if not S.cfg or not S.enabled then return prefix .. 'off' end
  if not S.client:is_open() then return prefix .. 'offline' end
  if not core.allowed(api.nvim_get_current_buf()) then return prefix .. 'excluded' end
  if indicator.generating() then return prefix .. 'generating' end
  local snoozed = core.snoozed()
  if snoozed then return prefix .. ('snoozed %dm'):format(math.ceil(snoozed)) end
  if S.cfg.trigger == 'manual' then return prefix .. 'manual' end
  return prefix .. 'ready'
end

--- True while the server generates the completion asked for (shown, or to
--- be shown as it streams in); false once it is done, failed, cancelled,
--- timed out or lost. Each change also sets g:completer_generating and fires
--- `User CompleterGenerating`.
M.generating = indicator.generating

--- True while a keystroke waits for its debounce or the completion shown is
--- still streaming (tests wait on it).
function M.busy()
  return S.pending_key ~= nil or (S.req ~= nil and S.req.done == nil)
end

--- The last finished request: id, kind, type, text (done.text), reason, deltas, timings.
function M.last_result() return S.results[#S.results] end
--- The last 50 finished requests, oldest first.
function M.results() return S.results end
--- The request shown now: id, text, consumed (bytes typed or accepted), done; nil if none.
function M.current()
  local r = S.req
  local c = r and r.cycle
  return r and { id = r.id, kind = r.kind, text = r.text, consumed = r.consumed, done = r.done ~= nil,
    shown = r.t_shown ~= nil, index = c and c.alts and c.i or nil, count = c and c.alts and #c.alts or nil }
end
--- The completion text shown now (nil when none).
function M.ghost_text() return ghost.text() end
--- Per-request timings (ms): ttft_ms (server), debounce_ms, key_to_shown_ms, send_to_shown_ms.
function M.latency() return S.latency end
--- Keystroke to ghost text (ms) of every completion shown and every
--- keystroke typed through one, with its source: 'complete' (a request),
--- 'cache', 'type_through'.
function M.ghost_latency() return S.shows end
function M.clear_latency()
  S.latency, S.shows = {}, {}
end
--- The context the next request in `buf` (default: the current one) would carry.
function M.context(buf)
  buf = buf or api.nvim_get_current_buf()
  local n = api.nvim_buf_line_count(buf)
  local row = buf == api.nvim_get_current_buf() and api.nvim_win_get_cursor(0)[1] - 1 or 0
  return core.context(buf, require('completer.text').window(row, n, S.cfg.max_lines))
end
--- The `workspace` the next request in `buf` would carry.
function M.workspace(buf) return S.definitions.workspace(buf or api.nvim_get_current_buf()) end
--- Why `buf` is not completed (a short reason), or nil when it is.
function M.blocked(buf) return S.cfg and privacy.blocked(buf or api.nvim_get_current_buf(), S.cfg) end
--- The options in force (after setup()).
function M.config() return S.cfg end

local function autocmds()
  local group = api.nvim_create_augroup('completer', { clear = true })
  local function au(events, fn)
    api.nvim_create_autocmd(events, { group = group, callback = function(ev) fn(ev) end })
  end
  au('InsertEnter', function()
    S.context:changed() -- picked up while out of insert mode: fixed for this insert
    core.on_edit(true)
  end)
  au({ 'TextChangedI', 'TextChangedP', 'CursorMovedI' }, function() core.on_edit(false) end)
  au('InsertLeave', function(ev)
    core.on_leave()
    S.context:pick_changed(ev.buf, 'edit')
    S.definitions:refresh(ev.buf)
  end)
  au('BufLeave', function(ev)
    core.on_leave()
    S.context:pick_cursor(ev.buf)
  end)
  au('TextYankPost', function(ev)
    if vim.v.event.operator == 'y' then S.context:pick_changed(ev.buf, 'yank') end
  end)
  au({ 'BufEnter', 'BufWinEnter' }, function(ev)
    S.context:changed()
    -- After the other BufEnter handlers (filetype, cursor restore) are done.
    vim.schedule(function()
      core.prime(ev.buf)
      S.definitions:refresh(ev.buf)
    end)
  end)
  if vim.fn.exists('##LspAttach') == 1 then -- 0.8+: a language server that starts late still counts
    au('LspAttach', function(ev) vim.schedule(function() S.definitions:refresh(ev.buf) end) end)
  end
  au({ 'BufDelete', 'BufWipeout', 'FileType' }, function(ev)
    S.primed[ev.buf] = nil
    S.definitions:forget(ev.buf)
    S.context:changed()
  end)
  au('CompleteChanged', function()
    if S.cfg.hide_during_pum then ghost.clear() end
  end)
  au('CompleteDone', function() vim.schedule(function() if core.in_insert() then core.refresh() end end) end)
  -- blink.cmp draws its own menu too and says so with User events; an
  -- autocommand needs nothing of it loaded (it may load after setup()).
  api.nvim_create_autocmd('User', { group = group, pattern = 'BlinkCmpMenuOpen', callback = function()
    if S.cfg.hide_during_pum then ghost.clear() end
  end })
  api.nvim_create_autocmd('User', { group = group, pattern = 'BlinkCmpMenuClose', callback = function()
    vim.schedule(function() if core.in_insert() then core.refresh() end end)
  end })
  au('VimLeavePre', function() S.client:stop() end)
  -- nvim-cmp draws its own menu (no CompleteChanged) and says when instead;
  -- only if it is loaded already (requiring it here would load it early).
  local cmp = package.loaded.cmp
  if type(cmp) == 'table' and cmp.event and not S.cmp_hooked then
    S.cmp_hooked = true
    pcall(function()
      cmp.event:on('menu_opened', function() if S.cfg.hide_during_pum then ghost.clear() end end)
      cmp.event:on('menu_closed', function()
        vim.schedule(function() if core.in_insert() then core.refresh() end end)
      end)
    end)
  end
  au('ColorScheme', function()
    vim.cmd('highlight default link ' .. S.cfg.hl_group .. ' Comment')
    vim.cmd('highlight default link ' .. ghost.COUNTER_HL .. ' ' .. S.cfg.hl_group)
  end)
end

function M.setup(opts)
  local cfg = config.build(opts) -- raises on a bad option, before anything changes
  if S.client then
    core.on_leave()
    S.client:stop()
  end
  S.requests, S.req, S.spec, S.prime_unsupported = {}, nil, nil, nil
  indicator.update()
  S.cfg, S.opts = cfg, opts or {}
  S.timer = S.timer or uv.new_timer()
  S.debounce = Debounce.new(cfg.debounce_min_ms, cfg.debounce_max_ms)
  S.cache = Cache.new(cfg.cache_size)
  S.context = Context.new(cfg)
  S.definitions = Definitions.new(cfg)
  S.primed = {}
  privacy.forget_ignored() -- (.gitignore files may have changed)
  S.client = Client.new(cfg, {
    on_message = replies.on_message, on_disconnect = replies.on_disconnect,
    on_open = function() vim.schedule(function() core.prime(api.nvim_get_current_buf()) end) end,
  })
  vim.cmd('highlight default link ' .. cfg.hl_group .. ' Comment')
  vim.cmd('highlight default link ' .. ghost.COUNTER_HL .. ' ' .. cfg.hl_group)
  autocmds()
  vim.on_key(function() S.last_key_ns = uv.hrtime() end, ghost.ns)
  keymaps.define_plugs()
  keymaps.map(cfg.keymaps)
  if cfg.enabled then M.enable() else S.enabled = false end
end

M._state = S
return M
