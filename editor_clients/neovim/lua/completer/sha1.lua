-- SHA-1 and base64 in pure Lua (LuaJIT's `bit`): just enough for the
-- WebSocket handshake (RFC 6455 section 4.2.2, Sec-WebSocket-Accept).
local bit = require('bit')
local band, bor, bxor, bnot = bit.band, bit.bor, bit.bxor, bit.bnot
local rol, tobit, tohex = bit.rol, bit.tobit, bit.tohex

local M = {}

local function be32(s, i)
  local a, b, c, d = s:byte(i, i + 3)
  return tobit(a * 0x1000000 + b * 0x10000 + c * 0x100 + d)
end

local function u32_bytes(n)
  n = n % 0x100000000
  return string.char(math.floor(n / 0x1000000) % 256, math.floor(n / 0x10000) % 256,
    math.floor(n / 0x100) % 256, n % 256)
end

--- SHA-1 of `msg` as 40 lowercase hex digits.
function M.hex(msg)
  local len = #msg
  local pad = (55 - len) % 64
  msg = msg .. '\128' .. string.rep('\0', pad) .. u32_bytes(math.floor(len * 8 / 0x100000000)) .. u32_bytes(len * 8)
  local h0, h1, h2, h3, h4 = tobit(0x67452301), tobit(0xEFCDAB89), tobit(0x98BADCFE), tobit(0x10325476),
    tobit(0xC3D2E1F0)
  local w = {}
  for chunk = 1, #msg, 64 do
    for i = 0, 15 do
      w[i] = be32(msg, chunk + i * 4)
    end
    for i = 16, 79 do
      w[i] = rol(bxor(w[i - 3], w[i - 8], w[i - 14], w[i - 16]), 1)
    end
    local a, b, c, d, e = h0, h1, h2, h3, h4
    for i = 0, 79 do
      local f, k
      if i < 20 then
        f, k = bor(band(b, c), band(bnot(b), d)), 0x5A827999
      elseif i < 40 then
        f, k = bxor(b, c, d), 0x6ED9EBA1
      elseif i < 60 then
        f, k = bor(band(b, c), band(b, d), band(c, d)), 0x8F1BBCDC
      else
        f, k = bxor(b, c, d), 0xCA62C1D6
      end
      local t = tobit(rol(a, 5) + f + e + k + w[i])
      e, d, c, b, a = d, c, rol(b, 30), a, t
    end
    h0, h1, h2, h3, h4 = tobit(h0 + a), tobit(h1 + b), tobit(h2 + c), tobit(h3 + d), tobit(h4 + e)
  end
  return tohex(h0) .. tohex(h1) .. tohex(h2) .. tohex(h3) .. tohex(h4)
end

--- SHA-1 of `msg` as 20 raw bytes.
function M.binary(msg)
  return (M.hex(msg):gsub('%x%x', function(h)
    return string.char(tonumber(h, 16))
  end))
end

local ALPHABET = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/'

--- Standard base64 (with `=` padding).
function M.base64(s)
  local out = {}
  for i = 1, #s, 3 do
    local a, b, c = s:byte(i, i + 2)
    local n = a * 0x10000 + (b or 0) * 0x100 + (c or 0)
    local q = {}
    for j = 1, 4 do
      local idx = math.floor(n / 2 ^ (6 * (4 - j))) % 64
      q[j] = ALPHABET:sub(idx + 1, idx + 1)
    end
    if not b then
      q[3], q[4] = '=', '='
    elseif not c then
      q[4] = '='
    end
    out[#out + 1] = table.concat(q)
  end
  return table.concat(out)
end

--- The Sec-WebSocket-Accept value a server must answer to `key`.
function M.websocket_accept(key)
  return M.base64(M.binary(key .. '258EAFA5-E914-47DA-95CA-C5AB0DC85B11'))
end

return M
