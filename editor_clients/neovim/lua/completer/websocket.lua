-- A WebSocket client (RFC 6455, client side) over vim.loop TCP: the opening
-- handshake with the Sec-WebSocket-Accept check, masked client frames,
-- reassembly of fragmented messages, ping/pong and the closing handshake.
-- Callbacks run on Neovim's main loop (vim.schedule), never in a fast event.
-- `heard_ms` is when the last bytes came in (any frame: data, ping, pong), so
-- the client above can tell a silent, half-open connection from a live one.
-- wss://: the bytes go through an `openssl s_client` process (tls.lua).
local bit = require('bit')
local sha1 = require('completer.sha1')
local uv = vim.loop

local M = {}
local Conn = {}
Conn.__index = Conn

--- Wall-clock milliseconds: unlike uv.hrtime, it counts the time the machine
--- slept, and a connection is as likely to be dead after a suspend as after
--- the same time awake.
function M.wall_ms()
  local s, us = uv.gettimeofday()
  return s * 1000 + us / 1000
end

local OP = { cont = 0, text = 1, binary = 2, close = 8, ping = 9, pong = 10 }
M.OP = OP

local function random_bytes(n)
  local ok, s = pcall(uv.random, n)
  if ok and type(s) == 'string' and #s == n then
    return s
  end
  local t = {}
  for i = 1, n do
    t[i] = math.random(0, 255)
  end
  return string.char(unpack(t))
end

--- XOR `payload` with the 4-byte `key` (masking and unmasking are the same).
function M.mask(payload, key)
  local k = { key:byte(1, 4) }
  local out, n = {}, #payload
  for i = 1, n, 4096 do
    local bytes = { payload:byte(i, math.min(i + 4095, n)) }
    for x = 1, #bytes do
      bytes[x] = bit.bxor(bytes[x], k[(x - 1) % 4 + 1])
    end
    out[#out + 1] = string.char(unpack(bytes))
  end
  return table.concat(out)
end

local function be_bytes(n, count)
  local t = {}
  for i = count, 1, -1 do
    t[i] = n % 256
    n = math.floor(n / 256)
  end
  return string.char(unpack(t))
end

--- One client frame: FIN set, masked with a fresh key.
function M.encode_frame(opcode, payload, fin)
  local len = #payload
  local head = string.char((fin == false and 0 or 0x80) + opcode)
  if len < 126 then
    head = head .. string.char(0x80 + len)
  elseif len < 65536 then
    head = head .. string.char(0x80 + 126) .. be_bytes(len, 2)
  else
    head = head .. string.char(0x80 + 127) .. be_bytes(len, 8)
  end
  local key = random_bytes(4)
  return head .. key .. M.mask(payload, key)
end

--- Open a connection. opts: host, port, path, headers (table), timeout_ms,
--- max_message (bytes), tls ({ openssl = command, ca_file = path or nil }:
--- wss://). handlers: on_open(), on_message(text, recv_ns),
--- on_close(code, reason, err, http_status) -- called exactly once.
function M.connect(opts, handlers)
  local self = setmetatable({
    opts = opts, h = handlers, state = 'connecting', buf = '', frags = nil,
    max_message = opts.max_message or 16 * 2 ^ 20,
  }, Conn)
  self.key = sha1.base64(random_bytes(16))
  local h = opts.host:find(':', 1, true) and ('[' .. opts.host .. ']') or opts.host
  opts.host_header = opts.host_header or (h .. ':' .. opts.port)
  self.timer = uv.new_timer()
  self.timer:start(opts.timeout_ms or 5000, 0, function()
    self:_fail('timed out connecting')
  end)
  local host = opts.host
  if opts.tls then
    self:_connect_tls()
  elseif host:match('^%d+%.%d+%.%d+%.%d+$') or host:find(':', 1, true) then
    self:_connect(host)
  else
    uv.getaddrinfo(host, nil, { socktype = 'stream' }, function(err, res)
      if err or not res or #res == 0 then
        return self:_fail('cannot resolve ' .. host .. ': ' .. tostring(err))
      end
      table.sort(res, function(a, b) return a.family == 'inet' and b.family ~= 'inet' end)
      self:_connect(res[1].addr)
    end)
  end
  return self
end

function Conn:_upgrade_request()
  local lines = {
    'GET ' .. self.opts.path .. ' HTTP/1.1', 'Host: ' .. self.opts.host_header,
    'Upgrade: websocket', 'Connection: Upgrade', 'Sec-WebSocket-Key: ' .. self.key,
    'Sec-WebSocket-Version: 13',
  }
  for name, value in pairs(self.opts.headers or {}) do
    lines[#lines + 1] = name .. ': ' .. value
  end
  return table.concat(lines, '\r\n') .. '\r\n\r\n'
end

function Conn:_connect(addr)
  if self.state ~= 'connecting' then return end
  self.tcp = uv.new_tcp()
  local ok, err = pcall(self.tcp.connect, self.tcp, addr, self.opts.port, function(cerr)
    if cerr then return self:_fail('cannot connect: ' .. cerr) end
    pcall(self.tcp.nodelay, self.tcp, true)
    self.tcp:read_start(function(rerr, chunk) self:_on_read(rerr, chunk) end)
    self.tcp:write(self:_upgrade_request())
  end)
  if not ok then self:_fail('cannot connect: ' .. tostring(err)) end
end

function Conn:_connect_tls()
  require('completer.tls').connect(self)
end

-- Every handler call goes through here, in order, on the main loop.
function Conn:_emit(name, ...)
  local args, n = { ... }, select('#', ...)
  local fn = self.h[name]
  if fn then
    vim.schedule(function() fn(unpack(args, 1, n)) end)
  end
end

function Conn:_finish(code, reason, err, http_status)
  if self.state == 'closed' then return end
  self.state = 'closed'
  if self.timer and not self.timer:is_closing() then self.timer:close() end
  if self.tcp and not self.tcp:is_closing() then
    pcall(self.tcp.read_stop, self.tcp)
    self.tcp:close()
  end
  for _, p in ipairs({ self.stdin, self.stdout, self.stderr }) do
    if not p:is_closing() then
      pcall(p.read_stop, p)
      p:close()
    end
  end
  -- openssl is ended; its handle is closed when it has exited (above).
  if self.proc and not self.proc_exit and not self.proc:is_closing() then pcall(self.proc.kill, self.proc, 'sigterm') end
  self:_emit('on_close', code, reason, err, http_status)
end

function Conn:_fail(err, http_status)
  self:_finish(1006, '', err, http_status)
end

function Conn:_on_read(err, chunk)
  if err or not chunk then
    return self:_fail(err and ('read error: ' .. err) or 'connection lost')
  end
  self.heard_ms = M.wall_ms()
  self.buf = self.buf .. chunk
  if self.state == 'connecting' then
    local stop = self.buf:find('\r\n\r\n', 1, true)
    if not stop then return end
    local head = self.buf:sub(1, stop - 1)
    self.buf = self.buf:sub(stop + 4)
    local problem, status = self:_check_handshake(head)
    if problem then return self:_fail(problem, status) end
    self.state = 'open'
    self.timer:stop()
    self:_emit('on_open')
  end
  self:_parse(uv.hrtime())
end

function Conn:_check_handshake(head)
  local status, text = head:match('^HTTP/1%.1 (%d%d%d) ?([^\r]*)')
  status = tonumber(status)
  if status ~= 101 then
    return ('HTTP %s %s'):format(status or '?', text or ''), status
  end
  local headers = {}
  for name, value in head:gmatch('\r\n([^:\r\n]+):[ \t]*([^\r\n]*)') do
    headers[name:lower()] = value
  end
  if (headers.upgrade or ''):lower() ~= 'websocket' or not (headers.connection or ''):lower():find('upgrade') then
    return 'not a WebSocket upgrade', status
  end
  if headers['sec-websocket-accept'] ~= sha1.websocket_accept(self.key) then
    return 'bad Sec-WebSocket-Accept', status
  end
end

function Conn:_protocol_error(code, why)
  self:_write(M.encode_frame(OP.close, be_bytes(code, 2) .. why))
  self:_finish(code, why, why)
end

function Conn:_parse(recv_ns)
  local buf, pos = self.buf, 1
  while self.state == 'open' or self.state == 'closing' do
    if #buf - pos + 1 < 2 then break end
    local b1, b2 = buf:byte(pos, pos + 1)
    local fin, opcode, masked, len = b1 >= 128, b1 % 16, b2 >= 128, b2 % 128
    local at = pos + 2
    if b1 % 128 >= 16 then return self:_protocol_error(1002, 'reserved bits set') end
    if len == 126 then
      if #buf < at + 1 then break end
      local x, y = buf:byte(at, at + 1)
      len, at = x * 256 + y, at + 2
    elseif len == 127 then
      if #buf < at + 7 then break end
      len = 0
      for i = at, at + 7 do len = len * 256 + buf:byte(i) end
      at = at + 8
    end
    if len > self.max_message then return self:_protocol_error(1009, 'message too big') end
    local key
    if masked then
      if #buf < at + 3 then break end
      key, at = buf:sub(at, at + 3), at + 4
    end
    if #buf < at + len - 1 then break end
    local payload = buf:sub(at, at + len - 1)
    if key then payload = M.mask(payload, key) end
    pos = at + len
    self:_frame(fin, opcode, payload, recv_ns)
  end
  self.buf = buf:sub(pos)
end

function Conn:_frame(fin, opcode, payload, recv_ns)
  if opcode >= 8 then
    if not fin or #payload > 125 then return self:_protocol_error(1002, 'bad control frame') end
    if opcode == OP.ping then
      self:_write(M.encode_frame(OP.pong, payload))
    elseif opcode == OP.close then
      local code = #payload >= 2 and payload:byte(1) * 256 + payload:byte(2) or 1005
      if self.state == 'open' then -- echo the server's close, then hang up
        self:_write(M.encode_frame(OP.close, payload:sub(1, 2)))
      end
      self:_finish(code, payload:sub(3))
    end
    return
  end
  if opcode == OP.cont then
    if not self.frags then return self:_protocol_error(1002, 'continuation without a message') end
    table.insert(self.frags, payload)
  elseif opcode == OP.text or opcode == OP.binary then
    if self.frags then return self:_protocol_error(1002, 'new message inside a fragmented one') end
    self.frags, self.frag_op = { payload }, opcode
  else
    return self:_protocol_error(1002, 'unknown opcode')
  end
  if fin then
    local message = table.concat(self.frags)
    self.frags = nil
    if #message > self.max_message then return self:_protocol_error(1009, 'message too big') end
    self:_emit('on_message', message, recv_ns, self.frag_op == OP.binary)
  end
end

function Conn:_write(data)
  local out = self.tcp or self.stdin
  if not out or out:is_closing() then return false end
  local ok, err = pcall(out.write, out, data)
  return ok and err ~= nil
end

--- Send one text message (a single masked frame). False when not open.
function Conn:send_text(text)
  if self.state ~= 'open' then return false end
  return self:_write(M.encode_frame(OP.text, text))
end

--- Send a raw frame (tests exercise fragmentation and pings with it).
function Conn:send_frame(opcode, payload, fin)
  if self.state ~= 'open' then return false end
  return self:_write(M.encode_frame(opcode, payload, fin))
end

--- Send a ping (the server's pong, like any frame, updates heard_ms).
function Conn:ping(payload)
  return self:send_frame(OP.ping, payload or '')
end

--- Drop the connection without a closing handshake (the peer no longer
--- answers, so waiting for its close would only add a second of silence).
function Conn:abort(err)
  self:_finish(1006, '', err)
end

--- Start the closing handshake; the socket is closed when the server answers
--- (or after a second).
function Conn:close(code, reason)
  if self.state == 'connecting' then return self:_finish(code or 1000, reason or '', 'closed by client') end
  if self.state ~= 'open' then return end
  self.state = 'closing'
  self:_write(M.encode_frame(OP.close, be_bytes(code or 1000, 2) .. (reason or '')))
  self.timer:start(1000, 0, function() self:_finish(code or 1000, reason or '') end)
end

return M
