-- Ghost text with extmarks: the completion's first line at the cursor (inline
-- virtual text on Neovim >= 0.10; before that overlay at the end of a line, or
-- after the line's end when the cursor is inside it), further lines as
-- virt_lines below. One extmark, updated in place (same id) as deltas stream
-- in or typing consumes it: it is never absent between two redraws, so the
-- ghost text does not flicker.
local api = vim.api

local M = {}

M.ns = api.nvim_create_namespace('completer')
M.has_inline = vim.fn.has('nvim-0.10') == 1

local current = nil -- { buf, id, text }

function M.split(text)
  return vim.split(text, '\n', { plain = true })
end

local function expand_tabs(s, ts)
  return (s:gsub('\t', string.rep(' ', ts)))
end

--- How the first line is placed at (row, col) of a line `line_len` bytes long.
function M.position(col, line_len)
  if M.has_inline then return 'inline' end
  if col >= line_len then return 'overlay' end
  return 'eol'
end

M.COUNTER_HL = 'CompleterCounter'

--- Show `text` at (row, col); `counter` (optional, ' 2/3': which candidate
--- this is) goes after its last line, in its own highlight, in the same
--- extmark (a second one at the line's end would overlap the overlay that
--- Neovim before 0.10 draws there).
function M.show(buf, row, col, text, hl, counter)
  local lines = M.split(text)
  local ts = vim.bo[buf].tabstop
  local line = api.nvim_buf_get_lines(buf, row, row + 1, false)[1] or ''
  col = math.min(col, #line)
  local opts = { hl_mode = 'combine', priority = 65000 }
  if current and current.buf == buf and api.nvim_buf_is_valid(buf) then
    opts.id = current.id
  else
    M.clear()
  end
  if lines[1] ~= '' then
    opts.virt_text = { { expand_tabs(lines[1], ts), hl } }
    opts.virt_text_pos = M.position(col, #line)
  end
  if #lines > 1 then
    local virt_lines = {}
    for i = 2, #lines do
      virt_lines[#virt_lines + 1] = { { expand_tabs(lines[i], ts), hl } }
    end
    opts.virt_lines = virt_lines
  end
  if counter then
    local last = opts.virt_lines and opts.virt_lines[#opts.virt_lines] or opts.virt_text
    if last then
      table.insert(last, { counter, M.COUNTER_HL })
    else -- a first line of nothing but a line break
      opts.virt_text, opts.virt_text_pos = { { counter, M.COUNTER_HL } }, M.position(col, #line)
    end
  end
  local ok, id = pcall(api.nvim_buf_set_extmark, buf, M.ns, row, col, opts)
  if not ok then
    M.clear()
    return false
  end
  current = { buf = buf, id = id, text = text }
  return true
end

function M.clear()
  if current and api.nvim_buf_is_valid(current.buf) then
    api.nvim_buf_clear_namespace(current.buf, M.ns, 0, -1)
  end
  current = nil
end

--- The text shown now, or nil.
function M.text()
  return current and current.text or nil
end

return M
