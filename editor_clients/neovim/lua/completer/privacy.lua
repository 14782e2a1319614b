-- Which buffers may be sent to the server, as the document of a request or as
-- context for another one: not special buffers, not filetypes switched off,
-- not files whose path matches a secrets glob (config.SECRETS: .env, keys,
-- certificates, credentials; unless exclude_sensitive_files is false) or an
-- `exclude` glob, only those matching `include` when it is set, and not a
-- buffer whose b:completer_enabled is false.
local config = require('completer.config')
local api = vim.api

local M = {}

-- glob -> the Vim regex it compiles to (glob2regpat is not free).
local compiled = {}

local function regex(glob)
  local re = compiled[glob]
  if not re then
    -- `\c`: case-insensitive, so `ID_RSA` and `Secrets.PEM` are caught too.
    re = vim.regex('\\c' .. vim.fn.glob2regpat(glob))
    compiled[glob] = re
  end
  return re
end

--- True when `path` matches `glob`: a glob with a `/` is matched against the
--- whole path (`**/secrets/*`), one without against the file's name only.
function M.match(glob, path)
  local subject = glob:find('/', 1, true) and path or vim.fn.fnamemodify(path, ':t')
  return regex(glob):match_str(subject) ~= nil
end

local function any(globs, path)
  for _, g in ipairs(globs or {}) do
    if M.match(g, path) then return g end
  end
end

--- The glob that excludes the file at `path` (absolute): one of the secrets
--- (unless exclude_sensitive_files is false), else one of `exclude`; nil if none.
function M.excluded(path, cfg)
  return (cfg.exclude_sensitive_files ~= false and any(config.SECRETS, path)) or any(cfg.exclude, path)
end

--- Why `buf` must not be sent (a short reason), or nil when it may be.
function M.blocked(buf, cfg)
  if not api.nvim_buf_is_valid(buf) then return 'invalid buffer' end
  local b = vim.b[buf]
  if b.completer_enabled == false then return 'b:completer_enabled is false' end
  local bo = vim.bo[buf]
  if bo.buftype ~= '' then return 'buftype=' .. bo.buftype end
  if b.completer_enabled ~= true then
    local ft = cfg.filetypes[bo.filetype]
    if ft == nil then ft = cfg.filetypes['*'] end
    if ft == false then return 'filetype ' .. bo.filetype .. ' is off' end
  end
  local name = api.nvim_buf_get_name(buf)
  if name ~= '' then
    local path = vim.fn.fnamemodify(name, ':p')
    local g = M.excluded(path, cfg)
    if g then return 'excluded by ' .. g end
    if cfg.include and #cfg.include > 0 and not any(cfg.include, path) then return 'not in include' end
  end
  return nil
end

--- Every glob that excludes a file: the secrets (unless switched off), then `exclude`.
function M.excluded_globs(cfg)
  local out = cfg.exclude_sensitive_files ~= false and vim.deepcopy(config.SECRETS) or {}
  for _, g in ipairs(cfg.exclude or {}) do out[#out + 1] = g end
  return out
end

--- True when a completion may be asked for in `buf` (it must also be editable).
function M.completes(buf, cfg)
  return M.blocked(buf, cfg) == nil and vim.bo[buf].modifiable
end

return M
