-- The connection to `completer serve`: connect, say hello, reconnect with
-- exponential backoff, and hand every decoded message to the plugin. Quiet by
-- design: a server that is down shows in :CompleterStatus, not in messages.
--
-- A connection can die without a close (the machine slept, a tunnel or NAT
-- dropped it, the server froze): TCP then reports nothing for minutes, writes
-- vanish and requests hang. The server pings every connection every 20 s, so
-- a healthy one is never silent for long: after `silence_ms` without a byte,
-- or when a request overruns its deadline (probe()), we ping, and no answer
-- within `pong_timeout_ms` means dead: the socket is dropped and we reconnect.
local config = require('completer.config')
local websocket = require('completer.websocket')
local uv = vim.loop

local M = {}
local Client = {}
Client.__index = Client

M.CLIENT_NAME = 'neovim/0.1.0'
M.PROTOCOL = 1

--- handlers: on_message(msg, recv_ns), on_disconnect(), on_open() (optional)
function M.new(cfg, handlers)
  return setmetatable({
    cfg = cfg, h = handlers, state = 'disconnected', attempts = 0, stopped = true,
    last_error = nil, server = nil, connects = 0, last_attempt_ns = 0, warned_auth = false,
    dead = 0, -- connections found dead by the liveness check
  }, Client)
end

function Client:is_open()
  return self.state == 'open' and self.conn ~= nil
end

function Client:start()
  self.stopped = false
  if self.state == 'disconnected' then self:_connect() end
end

function Client:stop()
  self.stopped = true
  self:_cancel_retry()
  self:_unwatch()
  if self.conn then
    local conn = self.conn
    self.conn = nil
    conn:close(1000, 'bye')
  end
  self.state = 'disconnected'
end

--- Called on each keystroke that wants a completion while not connected: try
--- at once if the last attempt is over a second old (the server may be back).
function Client:ensure()
  if self.stopped or self.state ~= 'disconnected' then return end
  if uv.hrtime() - self.last_attempt_ns >= 1e9 then
    self:_cancel_retry()
    self:_connect()
  end
end

function Client:_cancel_retry()
  if self.retry_timer then
    self.retry_timer:stop()
    self.retry_timer:close()
    self.retry_timer = nil
  end
  self.retry_at = nil
end

function Client:_connect()
  local url, err = config.parse_url(self.cfg.url)
  if not url then
    self.last_error = err
    return
  end
  local token, source = config.token(self.cfg)
  self.token_source = source
  local headers, path = {}, url.path
  if token and self.cfg.token_in_query then
    path = path .. (path:find('?', 1, true) and '&' or '?') .. 'token=' .. config.urlencode(token)
  elseif token then
    headers.Authorization = 'Bearer ' .. token
  end
  self.state = 'connecting'
  self.last_attempt_ns = uv.hrtime()
  local conn
  conn = websocket.connect({
    host = url.host, port = url.port, path = path, headers = headers,
    timeout_ms = self.cfg.connect_timeout_ms,
    tls = url.scheme == 'wss' and { openssl = self.cfg.openssl, ca_file = self.cfg.tls_ca_file } or nil,
  }, {
    on_open = function()
      if self.conn ~= conn then return end
      self.state, self.attempts, self.last_error = 'open', 0, nil
      self.connects = self.connects + 1
      conn:send_text(vim.json.encode({ type = 'hello', client = M.CLIENT_NAME, protocol = M.PROTOCOL }))
      self:_watch(conn)
      if self.h.on_open then self.h.on_open() end
    end,
    on_message = function(text, recv_ns, binary)
      if self.conn ~= conn or binary then return end
      local ok, msg = pcall(vim.json.decode, text)
      if not ok or type(msg) ~= 'table' then return end
      if msg.id == vim.NIL then msg.id = nil end
      if msg.type == 'ready' then
        self.server = msg
      elseif msg.type == 'error' and msg.id == nil then
        self.last_error = ('%s: %s'):format(tostring(msg.code), tostring(msg.message))
      end
      self.h.on_message(msg, recv_ns)
    end,
    on_close = function(code, reason, cerr, http_status)
      if self.conn ~= conn then return end
      local was_open = self.state == 'open'
      self:_unwatch()
      self.conn, self.state = nil, 'disconnected'
      self.last_error = cerr or ('closed by the server (%s %s)'):format(tostring(code), reason or '')
      if http_status == 401 then
        self.last_error = 'the server refused the token from ' .. tostring(source) .. ' (HTTP 401)'
        if not self.warned_auth then -- once per session, never per keystroke
          self.warned_auth = true
          vim.notify('completer: ' .. self.last_error .. '; see :help completer-token', vim.log.levels.WARN)
        end
      end
      local tls_problem = cerr and (cerr:find('^TLS:') or cerr:find('^wss:// needs'))
      if tls_problem and not self.warned_tls then -- as for the token: once, not on every retry
        self.warned_tls = true
        vim.notify('completer: ' .. cerr, vim.log.levels.WARN)
      end
      if was_open then self.h.on_disconnect() end
      self:_schedule_retry()
    end,
  })
  self.conn = conn
end

function Client:_schedule_retry()
  if self.stopped then return end
  local base = math.min(self.cfg.reconnect_max_ms, self.cfg.reconnect_min_ms * 2 ^ self.attempts)
  local delay = math.floor(base * (0.75 + 0.5 * math.random()))
  self.attempts = self.attempts + 1
  self:_cancel_retry()
  self.retry_timer = uv.new_timer()
  self.retry_at = uv.hrtime() + delay * 1e6
  self.retry_timer:start(delay, 0, vim.schedule_wrap(function()
    self:_cancel_retry()
    if not self.stopped and self.state == 'disconnected' then self:_connect() end
  end))
end

function Client:_watch(conn)
  self:_unwatch()
  self.probe_since = nil
  local c = self.cfg
  -- Often enough to notice a missing pong near its timeout, and at least once a second.
  local every = math.floor(math.max(50, math.min(1000, c.pong_timeout_ms / 4, c.silence_ms / 4)))
  self.watch_timer = uv.new_timer()
  self.watch_timer:start(every, every, vim.schedule_wrap(function() self:_check(conn) end))
end

function Client:_unwatch()
  if self.watch_timer then
    self.watch_timer:stop()
    self.watch_timer:close()
    self.watch_timer = nil
  end
  self.probe_since = nil
end

function Client:_check(conn)
  -- (conn.state is 'closed' from the moment it is aborted; on_close comes later)
  if self.conn ~= conn or self.state ~= 'open' or conn.state ~= 'open' then return end
  local now = websocket.wall_ms()
  local heard = conn.heard_ms or now
  if self.probe_since then
    if heard >= self.probe_since then
      self.probe_since = nil -- answered: alive
    elseif now - self.probe_since >= self.cfg.pong_timeout_ms then
      self:_dead(('no answer from the server for %.0f s (a ping got no pong within %d ms)')
        :format((now - heard) / 1000, self.cfg.pong_timeout_ms))
    end
  elseif now - heard >= self.cfg.silence_ms then
    self:probe()
  end
end

--- Ping the server now, unless a ping already waits for its answer (a
--- request overran its deadline: the connection may be dead).
function Client:probe()
  if not self:is_open() or self.conn.state ~= 'open' or self.probe_since then return end
  self.probe_since = websocket.wall_ms()
  if not self.conn:ping('completer') then self:_dead('the connection failed while pinging the server') end
end

function Client:_dead(why)
  self.dead = self.dead + 1
  self.conn:abort(why) -- on_close follows: disconnected, then a reconnect
end

--- Send one message (a table); false when not connected.
function Client:send(msg)
  if not self:is_open() then return false end
  return self.conn:send_text(vim.json.encode(msg))
end

function Client:status()
  return {
    state = self.state, url = self.cfg.url, error = self.last_error, server = self.server,
    token_source = self.token_source, connects = self.connects, attempts = self.attempts, dead = self.dead,
    retry_in_ms = self.retry_at and math.max(0, math.floor((self.retry_at - uv.hrtime()) / 1e6)) or nil,
  }
end

return M
