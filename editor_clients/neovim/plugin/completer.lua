-- :CompleterStatus, :CompleterToggle, :CompleterEnable, :CompleterDisable,
-- :CompleterSuggest, :CompleterNext, :CompleterPrev, :CompleterSnooze.
-- Completion itself starts with require('completer').setup() (:help completer).
if vim.g.loaded_completer or vim.fn.has('nvim-0.7') == 0 then
  return
end
vim.g.loaded_completer = true

local function status_text()
  local st = require('completer').status()
  if st.state == 'not set up' then
    return 'completer: not set up (call require("completer").setup())'
  end
  local parts = { ('completer: %s, %s'):format(st.enabled and 'enabled' or 'disabled', st.state) }
  parts[#parts + 1] = 'server: ' .. st.url
  if st.server and st.state == 'open' then
    local model = type(st.server.model) == 'table' and st.server.model or {}
    parts[#parts + 1] = ('%s, model %s, draft %s'):format(tostring(st.server.server), tostring(model.target),
      tostring(model.draft))
  end
  if st.error and st.state ~= 'open' then parts[#parts + 1] = 'last error: ' .. st.error end
  if st.retry_in_ms then parts[#parts + 1] = ('next try in %.1f s'):format(st.retry_in_ms / 1000) end
  if st.token_source then parts[#parts + 1] = 'token: ' .. st.token_source end
  if st.snoozed_min then
    parts[#parts + 1] = ('snoozed: no automatic completions for %d more min (:CompleterSnooze 0 ends it)')
      :format(math.ceil(st.snoozed_min))
  end
  if st.trigger == 'manual' then parts[#parts + 1] = 'trigger manual: completions only on :CompleterSuggest' end
  local c = st.counts
  parts[#parts + 1] = ('requests %d, shown %d, accepted %d, typed through %d chars, dismissed %d'):format(c.sent,
    c.shown, c.accepted, c.typed, c.dismissed)
  parts[#parts + 1] = ('cache hits %d, primed %d, speculative %d, timed out %d, dead connections %d'):format(
    c.cache_hits, c.primed, c.speculative, c.timeouts, st.dead or 0)
  if c.prompt_tokens > 0 then
    parts[#parts + 1] = ('prompt tokens %d, %.0f%% of them cached by the server'):format(c.prompt_tokens,
      100 * c.cached_tokens / c.prompt_tokens)
  end
  local fixed = require('completer').config().debounce_ms
  parts[#parts + 1] = ('debounce %d ms%s'):format(fixed or st.debounce.delay_ms, fixed and ' (fixed)' or ' (adaptive)')
  local blocked = require('completer').blocked()
  if blocked then parts[#parts + 1] = 'this buffer is not sent: ' .. blocked end
  local l = st.last_latency
  if l then
    parts[#parts + 1] = ('last: server ttft %.1f ms, request to ghost text %.1f ms, keystroke to ghost text %.1f ms')
      :format(l.ttft_ms, l.send_to_shown_ms or -1, l.key_to_shown_ms or -1)
  end
  return table.concat(parts, '\n  ')
end

vim.api.nvim_create_user_command('CompleterStatus', function()
  vim.api.nvim_echo({ { status_text() } }, false, {})
end, { desc = 'completer: connection, counters and latency' })

vim.api.nvim_create_user_command('CompleterToggle', function()
  local on = require('completer').toggle()
  vim.api.nvim_echo({ { 'completer: ' .. (on and 'enabled' or 'disabled') } }, false, {})
end, { desc = 'completer: enable or disable completions' })

vim.api.nvim_create_user_command('CompleterEnable', function()
  require('completer').enable()
end, { desc = 'completer: enable completions' })

vim.api.nvim_create_user_command('CompleterDisable', function()
  require('completer').disable()
end, { desc = 'completer: disable completions' })

-- From insert mode through <Cmd> (`inoremap <M-\> <Cmd>CompleterSuggest<CR>`):
-- typed on the command line they find no insert mode to complete in.
vim.api.nvim_create_user_command('CompleterSuggest', function()
  require('completer').suggest()
end, { desc = 'completer: ask for a completion here now' })

vim.api.nvim_create_user_command('CompleterNext', function()
  require('completer').next()
end, { desc = 'completer: the next candidate' })

vim.api.nvim_create_user_command('CompleterPrev', function()
  require('completer').prev()
end, { desc = 'completer: the previous candidate' })

vim.api.nvim_create_user_command('CompleterSnooze', function(args)
  local minutes = args.args ~= '' and tonumber(args.args) or 15
  if not minutes then
    return vim.api.nvim_echo({ { 'completer: :CompleterSnooze [minutes], 0 ends a snooze', 'ErrorMsg' } }, false, {})
  end
  require('completer').snooze(minutes)
  vim.api.nvim_echo({ { minutes > 0 and ('completer: snoozed for %g min'):format(minutes)
    or 'completer: snooze ended' } }, false, {})
end, { nargs = '?', desc = 'completer: no automatic completions for N minutes (default 15; 0 ends it)' })
