-- Pure helpers: the `document` of a request, and how much of a completion
-- "accept word" and "accept line" take.
local api = vim.api

local M = {}

--- Characters (code points) in a UTF-8 string: what the server counts.
function M.chars(s)
  local _, n = s:gsub('[^\128-\191]', '')
  return n
end

function M.uri(buf)
  local name = api.nvim_buf_get_name(buf)
  if name == '' then return 'untitled:' .. buf end
  local path = vim.fn.fnamemodify(name, ':p')
  return 'file://' .. path:gsub('[^%w%-%._~/]', function(c)
    return ('%%%02X'):format(c:byte())
  end)
end

--- { uri, language, prefix, suffix } around (row, col) (0-based row, byte col),
--- at most `max_lines` lines each side (0: the whole buffer).
function M.document(buf, row, col, max_lines)
  local n = api.nvim_buf_line_count(buf)
  local first, last = 0, n
  if max_lines and max_lines > 0 then
    first, last = math.max(0, row - max_lines), math.min(n, row + 1 + max_lines)
  end
  local before = api.nvim_buf_get_lines(buf, first, row + 1, false)
  local after = api.nvim_buf_get_lines(buf, row, last, false)
  local line = before[#before] or ''
  before[#before] = line:sub(1, col)
  after[1] = line:sub(col + 1)
  local suffix = table.concat(after, '\n')
  if last == n and vim.bo[buf].eol then suffix = suffix .. '\n' end
  local ft = vim.bo[buf].filetype
  return {
    uri = M.uri(buf),
    language = ft ~= '' and ft or 'plaintext',
    prefix = table.concat(before, '\n'),
    suffix = suffix,
  }
end

--- The mode to ask for: 'auto' is "block" on a blank line, else "line".
function M.mode(setting, prefix)
  if setting ~= 'auto' then return setting end
  local line = prefix:match('[^\n]*$')
  return line:match('^%s*$') and 'block' or 'line'
end

--- The next word of `text`: leading blanks, then a run of word characters or
--- of punctuation; a leading newline goes with the next line's indentation.
function M.next_word(text)
  return text:match('^\n[ \t]*') or text:match('^[ \t]*[%w_\128-\255]+') or text:match('^[ \t]*[^%w_%s\128-\255]+')
    or text:match('^[ \t]+') or text:sub(1, 1)
end

--- The rest of the current line (without its newline); when the text starts
--- with a newline, that newline and the next line.
function M.next_line(text)
  if text:sub(1, 1) == '\n' then return '\n' .. (text:match('^\n([^\n]*)') or '') end
  return text:match('^[^\n]*')
end

--- Insert `text` at (row, col) of `buf` and put the window's cursor after it.
function M.insert(buf, row, col, text)
  local lines = vim.split(text, '\n', { plain = true })
  api.nvim_buf_set_text(buf, row, col, row, col, lines)
  local new_row = row + #lines - 1
  local new_col = #lines == 1 and col + #lines[1] or #lines[#lines]
  api.nvim_win_set_cursor(0, { new_row + 1, new_col })
end

return M
