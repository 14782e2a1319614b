-- Which buffers may be sent to the server, as the document of a request or as
-- context for another one: not special buffers, not filetypes switched off,
-- not files whose path matches a secrets glob (config.SECRETS: .env, keys,
-- certificates, credentials; unless exclude_sensitive_files is false) or an
-- `exclude` glob, only those matching `include` when it is set, not a buffer
-- whose b:completer_enabled is false, and, with `exclude_gitignored`, not a
-- file git ignores.
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

-- path -> true/false: what `git check-ignore` said. blocked() runs on every
-- keystroke, git takes milliseconds: each path is asked about once (until
-- setup() or M.forget_ignored()).
local ignored = {}

--- Whether git ignores the file at `path` (absolute). No git, no repository,
--- or any other failure: not ignored (the option narrows, it never blocks
--- everything because git is missing).
function M.git_ignored(path)
  local known = ignored[path]
  if known ~= nil then return known end
  local result = false
  if vim.fn.executable('git') == 1 then
    local dir = vim.fn.fnamemodify(path, ':h')
    if vim.fn.isdirectory(dir) == 1 then
      -- -q: exit 0 when ignored, 1 when not, 128 outside a repository. A
      -- list, not a string: no shell, any character in the path is safe.
      vim.fn.system({ 'git', '-C', dir, 'check-ignore', '-q', '--', path })
      result = vim.v.shell_error == 0
    end
  end
  ignored[path] = result
  return result
end

function M.forget_ignored() ignored = {} end

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
    if cfg.exclude_gitignored and M.git_ignored(path) then return 'ignored by git' end
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
