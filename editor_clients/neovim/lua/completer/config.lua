-- Options of require('completer').setup(), their defaults (:help completer-options),
-- the server URL and the bearer token.
local M = {}

-- Files never sent, as a document or as context: secrets, always excluded
-- unless `exclude_sensitive_files = false`; `exclude` adds to them. A glob with
-- a `/` matches the whole path, one without the file's name (case-insensitive).
M.SECRETS = {
  -- The same list, in the same order, as the VS Code extension's (src/privacy.ts's
  -- SENSITIVE_GLOBS); tests/clients/test_secret_patterns.py holds the two to it.
  '.env', '.env.*', '*.env', '.envrc',
  '*.pem', '*.key', '*.p12', '*.pfx', '*.jks', '*.keystore', '*.gpg', '*.asc', '*.kdbx',
  'id_rsa*', 'id_dsa*', 'id_ecdsa*', 'id_ed25519*', '*.ppk',
  '.netrc', '_netrc', '.pgpass', '.npmrc', '.pypirc', '.git-credentials', '.htpasswd',
  'credentials', 'credentials.*', '*credentials*.json', 'secrets', 'secrets.*', '*.secret', '*.secrets',
  '*secret*.json', '*secret*.y*ml', 'client_secret*',
  '*.tfvars', '*.tfstate', '*.tfstate.*',
  '**/.ssh/**', '**/.aws/**', '**/.gnupg/**', '**/.docker/config.json', '**/.kube/config',
}

M.defaults = {
  url = 'ws://127.0.0.1:8750/v1/ws', -- the server's WebSocket endpoint (ws://, or wss:// through openssl)
  tls_ca_file = nil, -- wss://: a PEM file of the CAs to trust (nil: the system's)
  openssl = 'openssl', -- wss://: the openssl command that carries the TLS (Neovim's libuv has none)
  token = nil, -- bearer token; nil: $COMPLETER_TOKEN, then token_file
  token_file = nil, -- nil: $XDG_CONFIG_HOME/completer/token or ~/.config/completer/token
  token_in_query = false, -- send ?token= instead of the Authorization header
  enabled = true, -- start enabled (:CompleterToggle flips it)
  trigger = 'auto', -- 'auto': ask after a pause in typing; 'manual': only on :CompleterSuggest or keymaps.suggest
  candidates = 4, -- completions a cycle key asks for (the shown one included; 2 to 4; 1: cycling off)
  exclude_gitignored = false, -- true: send nothing of a file `git check-ignore` says is ignored
  debounce_ms = nil, -- a number: fixed wait after a keystroke; nil: 0 unless the server is busy or slow, within:
  debounce_min_ms = 0,
  debounce_max_ms = 200,
  mode = 'auto', -- 'auto' (block on a blank line, else line), 'line', 'block' or 'free'
  max_tokens = nil, -- nil: the server's default
  temperature = nil, -- nil: the server's default (0, greedy)
  deadline_ms = nil, -- nil: the server's default
  stop = nil, -- extra stop strings (a list)
  max_lines = 2000, -- at least this many lines sent before and after the cursor (0: the whole buffer)
  filetypes = { ['*'] = true, help = false, gitcommit = false, gitrebase = false, TelescopePrompt = false },
  exclude = {}, -- more path globs never sent, besides the secrets (M.SECRETS)
  exclude_sensitive_files = true, -- false: the secrets list no longer applies (only `exclude` does)
  include = nil, -- a list of path globs: only matching files are completed and sent as context
  type_through = true, -- typing what the ghost text begins with consumes it (no new request)
  cache_size = 256, -- recent completions kept for backspace-and-retype and revisits (0: none)
  prime = true, -- warm the server's cache for a buffer when it is entered (max_tokens 0)
  speculative = true, -- after a whole accept at a line's end, ask for the next line ahead
  context = { -- snippets of other code sent with each request (:help completer-context)
    enabled = true,
    max_chunks = 8, -- at most this many (the protocol allows 64)
    chunk_lines = 32, -- lines per snippet
    max_chars = 4000, -- characters of all snippets together
    buffers = 3, -- other loaded buffers of the same filetype that give a snippet each
    definitions = 8, -- with a language server attached: the definitions of this many imported names (0: none)
  },
  hide_during_pum = true, -- no ghost text while a popup menu is open
  keymaps = { -- false disables one; each falls back to the key's previous mapping, or the key itself
    accept = '<Tab>',
    accept_word = '<M-Right>',
    accept_line = '<M-C-Right>',
    dismiss = '<C-]>',
    next = '<M-]>', -- the next candidate (asked for on the first press)
    prev = '<M-[>', -- the previous candidate
    suggest = '<M-\\>', -- ask for a completion here now (the key of 'manual' trigger)
  },
  hl_group = 'CompleterGhost', -- linked to Comment unless defined
  reconnect_min_ms = 250, -- first reconnect delay; doubles up to reconnect_max_ms
  reconnect_max_ms = 30000,
  connect_timeout_ms = 3000,
  silence_ms = 25000, -- this long without a frame from the server: ping it (it pings every 20 s)
  pong_timeout_ms = 5000, -- no answer to that ping within this: the connection is dead, reconnect
  request_timeout_margin_ms = 2000, -- a request past its deadline (the server's, or deadline_ms) plus this is given up
  latency_records = 1000, -- per-request timings kept for require('completer').latency()
}

-- Options whose default is nil, with the type they take.
local OPTIONAL = {
  token = 'string', token_file = 'string', tls_ca_file = 'string', debounce_ms = 'number', max_tokens = 'number', temperature = 'number',
  deadline_ms = 'number', stop = 'table', include = 'table',
  request_timeout_ms = 'number', -- give a request up this long after it was sent (nil: its deadline plus the margin)
}

local islist = vim.islist or vim.tbl_islist -- vim.tbl_islist is deprecated from 0.10 on

local function merge(base, over)
  local out = vim.deepcopy(base)
  for k, v in pairs(over or {}) do
    -- A table of named options (context, keymaps, filetypes) is merged key by
    -- key; a list (exclude, stop) is replaced.
    if type(v) == 'table' and type(out[k]) == 'table' and not islist(out[k]) then
      out[k] = merge(out[k], v)
    else
      out[k] = v
    end
  end
  return out
end

local MODES = { auto = true, line = true, block = true, free = true }
local TRIGGERS = { auto = true, manual = true }

local function check(name, value, want)
  if type(value) ~= want then
    error(('completer: option %s must be a %s, not %s'):format(name, want, type(value)), 4)
  end
end

local function check_list(name, value)
  if value == nil then return end
  check(name, value, 'table')
  for _, v in ipairs(value) do check(name .. '[]', v, 'string') end
end

--- The options: the defaults with `opts` merged in (a list replaces a
--- list); a wrong type is an error naming the option.
function M.build(opts)
  local cfg = merge(M.defaults, opts)
  for name, value in pairs(cfg) do
    local default = M.defaults[name]
    if default ~= nil and not (name == 'keymaps' and value == false) then
      check(name, value, type(default))
      if type(default) == 'table' and not islist(default) then
        for k, v in pairs(value) do
          -- (false switches one key off)
          if default[k] ~= nil and not (name == 'keymaps' and v == false) then
            check(name .. '.' .. k, v, type(default[k]))
          end
        end
      end
    elseif OPTIONAL[name] and value ~= nil then
      check(name, value, OPTIONAL[name])
    end
  end
  check_list('exclude', cfg.exclude)
  check_list('include', cfg.include)
  check_list('stop', cfg.stop)
  if not MODES[cfg.mode] then
    error("completer: option mode must be 'auto', 'line', 'block' or 'free'", 3)
  end
  if not TRIGGERS[cfg.trigger] then error("completer: option trigger must be 'auto' or 'manual'", 3) end
  if cfg.candidates < 1 or cfg.candidates > 4 then error('completer: option candidates must be 1 to 4', 3) end
  if cfg.keymaps == false then cfg.keymaps = {} end
  return cfg
end

--- Option names in `opts` that are not options (a typo is otherwise silent).
function M.unknown(opts)
  local out = {}
  for name in pairs(opts or {}) do
    if M.defaults[name] == nil and not OPTIONAL[name] then out[#out + 1] = tostring(name) end
  end
  table.sort(out)
  return out
end

--- { scheme, host, port, path } of a ws:// URL, or nil and a message.
function M.parse_url(url)
  local scheme, rest = url:match('^(wss?)://(.+)$')
  if not scheme then return nil, 'not a ws:// or wss:// URL: ' .. url end
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
