-- :checkhealth completer: the Neovim version, the options, the token, and
-- whether the server answers (GET /healthz on its port, waited for here).
local M = {}

-- Neovim 0.10 renamed vim.health.report_* to vim.health.*; 0.7 has neither
-- in vim.health but the same functions in the 'health' module.
local function reporter()
  local h = vim.health
  if h and h.start then return { start = h.start, ok = h.ok, warn = h.warn, error = h.error, info = h.info } end
  h = (h and h.report_start) and h or require('health')
  return { start = h.report_start, ok = h.report_ok, warn = h.report_warn, error = h.report_error,
    info = h.report_info }
end

-- The status line of GET /healthz at host:port (nil and a reason on failure).
local function healthz(host, port, timeout_ms)
  local uv = vim.loop
  if not (host:match('^%d+%.%d+%.%d+%.%d+$') or host:find(':', 1, true)) then
    local res = uv.getaddrinfo(host, nil, { socktype = 'stream' }) -- no callback: resolves here
    if not res or not res[1] then return nil, 'cannot resolve ' .. host end
    host = res[1].addr
  end
  local tcp = uv.new_tcp()
  local answer, err, over = '', nil, false
  local ok, e = pcall(tcp.connect, tcp, host, port, function(cerr)
    if cerr then
      err, over = cerr, true
      return
    end
    tcp:read_start(function(rerr, chunk)
      if rerr or not chunk then
        err, over = rerr, true
        return
      end
      answer = answer .. chunk
      if answer:find('\r\n') then over = true end
    end)
    tcp:write(('GET /healthz HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n'):format(host, port))
  end)
  if not ok then err, over = tostring(e), true end
  vim.wait(timeout_ms, function() return over end, 20)
  if not tcp:is_closing() then tcp:close() end
  local status = answer:match('^HTTP/1%.%d (%d+[^\r\n]*)')
  if status then return status end
  return nil, err or (over and 'no answer' or ('no answer within ' .. timeout_ms .. ' ms'))
end

-- The same over TLS, through `openssl s_client` as the plugin connects (its
-- certificate checks included): the status line, or nil and why.
local function healthz_tls(url, cfg, timeout_ms)
  local args = require('completer.tls').openssl_args(url.host, url.port, cfg.tls_ca_file)
  local out, err = {}, {}
  local ok, job = pcall(vim.fn.jobstart, vim.list_extend({ cfg.openssl }, args), {
    on_stdout = function(_, data) vim.list_extend(out, data) end,
    on_stderr = function(_, data) vim.list_extend(err, data) end,
  })
  if not ok or job <= 0 then return nil, cfg.openssl .. ' cannot run' end
  vim.fn.chansend(job, ('GET /healthz HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n'):format(url.host,
    url.port))
  local code = vim.fn.jobwait({ job }, timeout_ms)[1]
  if code == -1 then vim.fn.jobstop(job) end
  local status = table.concat(out, '\n'):match('^HTTP/1%.%d (%d+[^\r\n]*)')
  if status then return status end
  local e = table.concat(err, ' ')
  local verify = e:match('verify error:num=%d+:([^\r\n]-) ') or e:match('verify error:num=%d+:(.*)')
  if verify then return nil, 'the certificate did not verify: ' .. verify end
  return nil, code == -1 and ('no answer within ' .. timeout_ms .. ' ms') or ('openssl: ' .. vim.trim(e))
end

function M.check()
  local r = reporter()
  local config = require('completer.config')
  local completer = require('completer')

  r.start('completer: Neovim')
  local v = vim.version()
  local version = ('%d.%d.%d'):format(v.major, v.minor, v.patch)
  if vim.fn.has('nvim-0.7') == 1 then
    r.ok('Neovim ' .. version .. (vim.fn.has('nvim-0.10') == 1 and ' (inline ghost text)'
      or ' (ghost text at the end of the line; inline needs 0.10)'))
  else
    r.error('Neovim ' .. version .. ': completer needs 0.7 or later')
  end

  r.start('completer: configuration')
  local cfg = completer.config()
  if not cfg then
    r.warn('setup() has not been called: nothing is completed',
      { "Call require('completer').setup({}) in your init.lua" })
    cfg = config.build({})
  else
    local opts = completer._state.opts or {}
    local ok, err = pcall(config.build, opts)
    if ok then r.ok('options are valid') else r.error(tostring(err)) end
    local unknown = config.unknown(opts)
    if #unknown > 0 then
      r.warn('unknown options (ignored): ' .. table.concat(unknown, ', '), { ':help completer-options' })
    end
    r.info(('%s; %d excluded path globs%s; context %s'):format(completer.is_enabled() and 'enabled' or 'disabled',
      #require('completer.privacy').excluded_globs(cfg), cfg.exclude_gitignored and ' and files git ignores' or '',
      cfg.context.enabled and 'on' or 'off'))
    if cfg.exclude_sensitive_files == false then
      r.warn('exclude_sensitive_files = false: .env files, keys and credentials may be sent to the server')
    end
    local snoozed = completer.snoozed()
    if cfg.trigger == 'manual' then
      r.info('trigger manual: completions only on :CompleterSuggest or keymaps.suggest')
    elseif snoozed then
      r.info(('snoozed for %d more min (:CompleterSnooze 0 ends it)'):format(math.ceil(snoozed)))
    end
  end

  r.start('completer: token')
  local token, source = config.token(cfg)
  if token then
    r.ok('token from ' .. source)
  else
    r.error('no token: ' .. tostring(source), { '`completer serve` writes one; see :help completer-token' })
  end

  r.start('completer: server')
  local url, err = config.parse_url(cfg.url)
  if not url then return r.error(err) end
  local status, why
  if url.scheme == 'wss' then
    if vim.fn.executable(cfg.openssl) == 1 then
      r.ok(('wss://: TLS through %s, certificates checked against %s'):format(vim.fn.exepath(cfg.openssl),
        cfg.tls_ca_file or "the system's CAs"))
      status, why = healthz_tls(url, cfg, 3000)
    else
      r.error(('wss:// needs the openssl command, and %s is not found'):format(cfg.openssl),
        { 'Install OpenSSL, set the openssl option to its path, or use ws:// over an SSH tunnel' })
      return
    end
  else
    status, why = healthz(url.host, url.port, 2000)
  end
  if not status then
    r.error(('%s does not answer: %s'):format(cfg.url, tostring(why)), { 'Start it: completer serve' })
  elseif status:match('^200') then
    r.ok(('%s is reachable (GET /healthz: %s)'):format(cfg.url, status))
  else
    r.warn(('%s answers GET /healthz with %s (still loading its models?)'):format(cfg.url, status))
  end
  local st = completer.status()
  if st.state == 'open' then
    local model = type(st.server) == 'table' and type(st.server.model) == 'table' and st.server.model or {}
    r.ok(('connected: %s, model %s'):format(tostring(st.server and st.server.server), tostring(model.target)))
  elseif st.state ~= 'not set up' then
    r.warn(('not connected (%s)%s'):format(st.state, st.error and (': ' .. st.error) or ''))
  end
end

return M
