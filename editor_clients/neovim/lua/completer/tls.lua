-- wss:// for the WebSocket client (websocket.lua): Neovim's libuv has no
-- TLS, so the bytes go through an `openssl s_client` process (its stdin and
-- stdout are the socket), which checks the server's certificate and its name
-- and refuses the connection otherwise. It exists wherever OpenSSL does, on
-- every Neovim version.
local uv = vim.loop

local M = {}

--- The arguments of `openssl s_client` for this connection: verify the
--- chain (against ca_file, else the system's CAs) and the host's name (or
--- IP address), and give up on a certificate that fails (by default
--- s_client only reports it and goes on). -quiet: nothing but the server's
--- bytes on stdout; -no_ign_eof: the connection ends when Neovim does (its
--- end of our pipe closes); -nocommands: a frame that starts with Q, R or
--- K is data, not an s_client command.
function M.openssl_args(host, port, ca_file)
  local ip = host:match('^%d+%.%d+%.%d+%.%d+$') or host:find(':', 1, true)
  local connect = (host:find(':', 1, true) and ('[' .. host .. ']') or host) .. ':' .. port
  local args = { 's_client', '-quiet', '-no_ign_eof', '-nocommands', '-verify_return_error', '-connect', connect }
  if ip then
    vim.list_extend(args, { '-verify_ip', host })
  else
    vim.list_extend(args, { '-verify_hostname', host, '-servername', host })
  end
  if ca_file then vim.list_extend(args, { '-CAfile', vim.fn.expand(ca_file) }) end
  return args
end

-- What went wrong, from s_client's stderr, in one line a user can act on.
local function tls_error(stderr, code, ca_file)
  local verify = stderr:match('verify error:num=%d+:([^\r\n]*)')
    or stderr:match('[Cc]ertificate verify failed[^\r\n]*')
  if verify then
    return ('TLS: the server\'s certificate did not verify (%s)%s'):format(verify,
      ca_file and (' against tls_ca_file ' .. ca_file) or '; set tls_ca_file to the CA that signed it')
  end
  local last = stderr:gsub('%s+$', ''):match('([^\r\n]*)$') or ''
  if stderr:find('connect:errno', 1, true) or stderr:find('Connection refused', 1, true) then
    return 'cannot connect: ' .. last
  end
  return ('TLS: openssl s_client failed (exit %s)%s'):format(tostring(code), last ~= '' and (': ' .. last) or '')
end

--- Start `conn`'s wss:// connection (websocket.lua's Conn): s_client's stdin
--- and stdout become its socket, the upgrade request waits in the pipe.
function M.connect(conn)
  local tls = conn.opts.tls
  local stdin, stdout, stderr = uv.new_pipe(false), uv.new_pipe(false), uv.new_pipe(false)
  conn.stdin, conn.stdout, conn.stderr = stdin, stdout, stderr
  local errors = {}
  local handle, pid
  handle, pid = uv.spawn(tls.openssl or 'openssl', {
    args = M.openssl_args(conn.opts.host, conn.opts.port, tls.ca_file),
    stdio = { stdin, stdout, stderr },
  }, function(code)
    -- Before the upgrade's answer: the TLS handshake (or the connect) failed.
    -- After it, the server (or the network) ended the connection. Let the
    -- last of stderr come in first.
    conn.proc_exit = code
    if not handle:is_closing() then handle:close() end -- (closed once exited: libuv has reaped it)
    vim.defer_fn(function()
      if conn.state == 'connecting' then
        conn:_fail(tls_error(table.concat(errors), code, tls.ca_file))
      else
        conn:_fail('connection lost (openssl exited with ' .. tostring(code) .. ')')
      end
    end, 50)
  end)
  if not handle then
    -- (pid holds the error: ENOENT when the command does not exist)
    for _, p in ipairs({ stdin, stdout, stderr }) do p:close() end
    conn.stdin, conn.stdout, conn.stderr = nil, nil, nil
    return conn:_fail(('wss:// needs the openssl command to carry TLS, and %s cannot run (%s); install OpenSSL '
      .. 'or set the openssl option to its path'):format(tls.openssl or 'openssl', tostring(pid)))
  end
  conn.proc = handle
  stderr:read_start(function(_, chunk) if chunk then errors[#errors + 1] = chunk end end)
  stdout:read_start(function(rerr, chunk)
    if not chunk and not rerr then return end -- EOF: the exit callback says why
    conn:_on_read(rerr, chunk)
  end)
  -- s_client reads its stdin once the TLS handshake is done: the request
  -- waits in the pipe until then.
  stdin:write(conn:_upgrade_request())
end

return M
