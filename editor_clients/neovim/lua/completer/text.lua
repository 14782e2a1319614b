-- Pure helpers: the `document` of a request and the window of lines it
-- carries, the mode to ask for, where the cursor stands (a snapshot that
-- type-through and the cache compare), and how much of a completion "accept
-- word" and "accept line" take.
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

--- The step in which the window's edges move. The server keeps the start of
--- its own window on a 32-line grid counted from the first line it receives,
--- so a start that moved with every new line would change the prompt's first
--- tokens on every Enter and throw its warm cache away. Moving in steps of a
--- multiple of 32 (half the window, so it still holds at least `max_lines`)
--- keeps the start still for many lines and, when it does move, keeps the
--- server's grid where it was.
function M.window_step(max_lines)
  if max_lines >= 64 then return math.floor(max_lines / 64) * 32 end
  return math.max(1, math.floor(max_lines / 2))
end

--- The lines [first, last) sent for a cursor on `row` (0-based) of a buffer
--- of `n` lines: at least `max_lines` each side (fewer only at the buffer's
--- edges), edges snapped outwards to multiples of window_step (0: all).
function M.window(row, n, max_lines)
  if not max_lines or max_lines <= 0 then return 0, n end
  local step = M.window_step(max_lines)
  local first = math.max(0, math.floor((row - max_lines) / step) * step)
  local last = math.min(n, math.ceil((row + 1 + max_lines) / step) * step)
  return first, last
end

--- { uri, language, prefix, suffix } around (row, col) (0-based row, byte
--- col), and the window's first and last line (see M.window).
function M.document(buf, row, col, max_lines)
  local n = api.nvim_buf_line_count(buf)
  local first, last = M.window(row, n, max_lines)
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
  }, first, last
end

--- The mode to ask for: 'auto' is "block" on a blank line (blank both before
--- and after the cursor: a new statement may follow), else "line" (code after
--- the cursor is the rest of a statement, and only the line can be finished).
function M.mode(setting, before, after)
  if setting ~= 'auto' then return setting end
  return (before:match('^%s*$') and (after or ''):match('^%s*$')) and 'block' or 'line'
end

-- Lines of context a snapshot holds above and below the cursor's line: what
-- keys the cache (a completion depends mostly on the nearby text).
local ABOVE, BELOW = 16, 4

--- Where the cursor stands: its line split at the cursor, and the lines
--- around it. Type-through compares snapshots; the cache keys on them.
function M.snapshot(buf, row, col)
  local lines = api.nvim_buf_get_lines(buf, math.max(0, row - ABOVE), row + 1 + BELOW, false)
  local at = math.min(row, ABOVE) + 1
  local line = lines[at] or ''
  local indent = vim.bo[buf].autoindent and line:match('^[ \t]*') or ''
  return {
    buf = buf, row = row, col = col, uri = M.uri(buf), line = line, indent = indent,
    before = line:sub(1, col), after = line:sub(col + 1),
    above_lines = { unpack(lines, 1, at - 1) },
    above = table.concat(lines, '\n', 1, at - 1),
    below = table.concat(lines, '\n', at + 1),
    tick = api.nvim_buf_get_changedtick(buf),
  }
end

--- The snapshot Enter would lead to from `snap`, a cursor at the end of its
--- line: a new line holding the indentation 'autoindent' copies (what
--- 'smartindent' or an 'indentexpr' would add is not guessed; a wrong guess
--- only misses the cache).
function M.after_enter(snap)
  local above = { unpack(snap.above_lines) }
  above[#above + 1] = snap.line
  while #above > ABOVE do table.remove(above, 1) end
  return {
    buf = snap.buf, row = snap.row + 1, col = #snap.indent, uri = snap.uri, line = snap.indent,
    indent = snap.indent, before = snap.indent, after = '', above_lines = above,
    above = table.concat(above, '\n'), below = snap.below,
  }
end

--- The cache key of a snapshot whose text before the cursor is `before`
--- (the snapshot's own by default).
function M.key(snap, before)
  return table.concat({ snap.uri, snap.above, before or snap.before, snap.after, snap.below }, '\0')
end

--- What the user typed at `snap` since `origin` (a snapshot taken when a
--- completion was asked for): the text added before the cursor on the same
--- line, everything else unchanged; nil when the state is not such.
function M.typed_since(origin, snap)
  if snap.buf ~= origin.buf or snap.row ~= origin.row or snap.after ~= origin.after
      or snap.above ~= origin.above or snap.below ~= origin.below or #snap.before < #origin.before
      or snap.before:sub(1, #origin.before) ~= origin.before then
    return nil
  end
  return snap.before:sub(#origin.before + 1)
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
