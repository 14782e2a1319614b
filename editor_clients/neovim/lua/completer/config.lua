-- Options of require('completer').setup(), their defaults (:help completer-options),
-- the server URL and the bearer token.
local M = {}

M.defaults = {
  url = 'ws://127.0.0.1:8750/v1/ws', -- the server's WebSocket endpoint (ws:// only)
  token = nil, -- bearer token; nil: $COMPLETER_TOKEN, then token_file
  token_file = nil, -- nil: $XDG_CONFIG_HOME/completer/token or ~/.config/completer/token
  token_in_query = false, -- send ?token= instead of the Authorization header
  enabled = true, -- start enabled (:CompleterToggle flips it)
  debounce_ms = 50, -- quiet time after a keystroke before a request is sent
  mode = 'auto', -- 'auto' (block on a blank line, else line), 'line', 'block' or 'free'
  max_tokens = nil, -- nil: the server's default
  temperature = nil, -- nil: the server's default (0, greedy)
  deadline_ms = nil, -- nil: the server's default
  stop = nil, -- extra stop strings (a list)
  max_lines = 2000, -- lines sent before and after the cursor (0: the whole buffer)
  filetypes = { ['*'] = true, help = false, gitcommit = false, gitrebase = false, TelescopePrompt = false },
  keymaps = { -- false disables one; each falls back to the key's own action when nothing is shown
    accept = '<Tab>',
    accept_word = '<M-Right>',
    accept_line = '<M-C-Right>',
    dismiss = '<C-]>',
  },
  hl_group = 'CompleterGhost', -- linked to Comment unless defined
  reconnect_min_ms = 250, -- first reconnect delay; doubles up to reconnect_max_ms
  reconnect_max_ms = 30000,
  connect_timeout_ms = 3000,
  latency_records = 1000, -- per-request timings kept for require('completer').latency()
}

local islist = vim.islist or vim.tbl_islist -- vim.tbl_islist is deprecated from 0.10 on

local function merge(base, over)
  local out = vim.deepcopy(base)
  for k, v in pairs(over or {}) do
    if type(v) == 'table' and type(out[k]) == 'table' and not islist(v) then
      out[k] = merge(out[k], v)
    else
      out[k] = v
    end
  end
  return out
end

local MODES = { auto = true, line = true, block = true, free = true }

--- The options: the defaults with `opts` merged in; a wrong type is an error
--- naming the option.
function M.build(opts)
  local cfg = merge(M.defaults, opts)
  for name, value in pairs(cfg) do
    local default = M.defaults[name]
    if default ~= nil and type(value) ~= type(default) and not (name == 'keymaps' and value == false) then
      error(('completer: option %s must be a %s, not %s'):format(name, type(default), type(value)), 3)
    end
  end
  if not MODES[cfg.mode] then
    error("completer: option mode must be 'auto', 'line', 'block' or 'free'", 3)
  end
  if cfg.keymaps == false then cfg.keymaps = {} end
  return cfg
end

--- { scheme, host, port, path } of a ws:// URL, or nil and a message.
function M.parse_url(url)
  local scheme, rest = url:match('^(wss?)://(.+)$')
  if not scheme then return nil, 'not a ws:// URL: ' .. url end
  local authority, path = rest:match('^([^/?]+)(.*)$')
  if not authority then return nil, 'no host in ' .. url end
  local host, port = authority:match('^%[(.+)%]:?(%d*)$')
  if not host then host, port = authority:match('^([^:]+):?(%d*)$') end
  if not host then return nil, 'bad host in ' .. url end
  port = tonumber(port) or (scheme == 'wss' and 443 or 80)
  if path == '' then path = '/v1/ws' end
  return { scheme = scheme, host = host, port = port, path = path }
end

function M.token_path(cfg)
  if cfg.token_file then return vim.fn.expand(cfg.token_file) end
  local base = vim.env.XDG_CONFIG_HOME
  if not base or base == '' then base = (vim.env.HOME or '~') .. '/.config' end
  return base .. '/completer/token'
end

--- The token and where it came from (nil when there is none).
function M.token(cfg)
  if cfg.token and cfg.token ~= '' then return cfg.token, 'setup()' end
  local env = vim.env.COMPLETER_TOKEN
  if env and env ~= '' then return env, '$COMPLETER_TOKEN' end
  local path = M.token_path(cfg)
  local f = io.open(path, 'r')
  if not f then return nil, path .. ' (missing)' end
  local token = (f:read('*a') or ''):gsub('%s+$', ''):gsub('^%s+', '')
  f:close()
  if token == '' then return nil, path .. ' (empty)' end
  return token, path
end

function M.urlencode(s)
  return (s:gsub('[^%w%-%._~]', function(c)
    return ('%%%02X'):format(c:byte())
  end))
end

return M
