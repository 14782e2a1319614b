-- Insert-mode keys. Every action has a <Plug> mapping, for users who map
-- keys themselves (with require('completer').visible() to decide). The
-- default keys (`keymaps` option) do their action while ghost text is shown
-- and no popup menu is open (next, prev and suggest: while the buffer is
-- completed at all); otherwise they do what they did before the plugin: the
-- mapping the key had (kept under a <Plug>(completer-fallback-*) name and
-- called through it) or, with none, the key itself. <Tab> as the accept key
-- yields to a snippet that has a next place to jump to (vim.snippet on 0.10+,
-- LuaSnip): inside a snippet, Tab is the snippet's.
local api = vim.api
local accept = require('completer.accept')
local core = require('completer.core')

local M = {}

M.PLUG = {
  accept = '<Plug>(completer-accept)',
  accept_word = '<Plug>(completer-accept-word)',
  accept_line = '<Plug>(completer-accept-line)',
  dismiss = '<Plug>(completer-dismiss)',
  complete = '<Plug>(completer-complete)',
  next = '<Plug>(completer-next)',
  prev = '<Plug>(completer-prev)',
  suggest = '<Plug>(completer-complete)', -- (the same action: ask here now)
}
local KIND = { accept = 'all', accept_word = 'word', accept_line = 'line' }
local DESC = 'completer: ' -- marks our mappings (a second setup() must not take them for the user's)

function M.define_plugs()
  for name, kind in pairs(KIND) do
    vim.keymap.set('i', M.PLUG[name], function() return accept.accept_keys(kind) end,
      { expr = true, silent = true, desc = DESC .. name })
  end
  vim.keymap.set('i', M.PLUG.dismiss, '<Cmd>lua require("completer").dismiss()<CR>',
    { silent = true, desc = DESC .. 'dismiss' })
  vim.keymap.set('i', M.PLUG.complete, '<Cmd>lua require("completer").complete()<CR>',
    { silent = true, desc = DESC .. 'complete' })
  vim.keymap.set('i', M.PLUG.next, '<Cmd>lua require("completer").next()<CR>', { silent = true, desc = DESC .. 'next' })
  vim.keymap.set('i', M.PLUG.prev, '<Cmd>lua require("completer").prev()<CR>', { silent = true, desc = DESC .. 'prev' })
end

--- The snippet engine that has somewhere to go on <Tab> ('vim.snippet',
--- 'luasnip'), or nil. Feature-detected: vim.snippet is 0.10+, LuaSnip only
--- counts when loaded.
function M.snippet_active()
  local snippet = vim.snippet
  if snippet and type(snippet.active) == 'function' then
    local ok, active = pcall(snippet.active, { direction = 1 })
    if ok and active then return 'vim.snippet' end
  end
  local ls = package.loaded.luasnip
  if type(ls) == 'table' then
    for _, fn in ipairs({ 'expand_or_jumpable', 'jumpable' }) do
      if type(ls[fn]) == 'function' then
        local ok, yes = pcall(ls[fn], 1)
        if ok and yes then return 'luasnip' end
      end
    end
  end
end

--- <Tab> inside a snippet: jump to its next place.
function M.snippet_jump()
  local which = M.snippet_active()
  if which == 'vim.snippet' then
    vim.snippet.jump(1)
  elseif which == 'luasnip' then
    local ls = package.loaded.luasnip
    if type(ls.expand_or_jump) == 'function' then ls.expand_or_jump() else ls.jump(1) end
  end
end

local SNIPPET_JUMP = '<Cmd>lua require("completer.keymaps").snippet_jump()<CR>'

-- When each default key does its own action (else it falls back).
local function acts(name)
  if KIND[name] then return core.visible() and not core.pum_open() end
  if name == 'dismiss' then return core.visible() end
  -- next, prev, suggest: wherever a completion may be asked for.
  return core.S.enabled and not core.pum_open() and core.allowed(api.nvim_get_current_buf())
end

local function norm(lhs) return api.nvim_replace_termcodes(lhs, true, true, true) end

-- The global insert-mode mapping of `lhs` other than ours, or nil.
local function previous(lhs)
  local want = norm(lhs)
  for _, m in ipairs(api.nvim_get_keymap('i')) do
    if norm(m.lhs) == want and not (m.desc or ''):find('^' .. DESC) then return m end
  end
end

-- Map `lhs` (or `plug` when given) as `m` was mapped.
local function copy(m, lhs)
  local opts = { expr = m.expr == 1, noremap = m.noremap == 1, silent = m.silent == 1, nowait = m.nowait == 1 }
  if m.callback then opts.callback = m.callback end
  if m.replace_keycodes ~= nil then opts.replace_keycodes = m.replace_keycodes == 1 end
  local rhs = (m.rhs or ''):gsub('<[Ss][Ii][Dd]>', '<SNR>' .. tostring(m.sid or 0) .. '_')
  -- A remappable rhs that starts with its own key relied on Vim not mapping
  -- that first key again; under another name it would reach our mapping and
  -- loop, so it is copied as noremap.
  local key = norm(m.lhs)
  if not opts.noremap and not opts.expr and norm(rhs):sub(1, #key) == key then opts.noremap = true end
  api.nvim_set_keymap('i', lhs, rhs, opts)
end

local mapped = {} -- lhs -> the user's mapping it had (false: none), for a later setup()

--- Put the default keys of `keymaps` in place (undoing an earlier setup's).
function M.map(keymaps)
  for lhs, m in pairs(mapped) do
    pcall(vim.keymap.del, 'i', lhs)
    if m then copy(m, lhs) end
  end
  mapped = {}
  for _, name in ipairs({ 'accept', 'accept_word', 'accept_line', 'dismiss', 'next', 'prev', 'suggest' }) do
    local lhs = keymaps[name]
    if lhs then
      local m = previous(lhs)
      local fallback = '<Plug>(completer-fallback-' .. name .. ')'
      if m then copy(m, fallback) else api.nvim_set_keymap('i', fallback, lhs, { noremap = true }) end
      local tab = name == 'accept' and norm(lhs) == norm('<Tab>')
      vim.keymap.set('i', lhs, function()
        -- Inside a snippet Tab jumps, as it would without ghost text.
        if tab and M.snippet_active() then return SNIPPET_JUMP end
        -- Not while a popup menu is open: the key is the menu's then.
        if acts(name) then return M.PLUG[name] end
        return fallback
      end, { expr = true, remap = true, silent = true, desc = DESC .. name })
      mapped[lhs] = m or false
    end
  end
end

return M
