-- Accepting ghost text: all of it, the next word or the rest of the line,
-- as the keys (<Plug>(completer-accept*)) that insert it. What a partial
-- accept leaves is shown from the new cursor; a whole accept asks for the
-- next completion at once.
local core = require('completer.core')
local ghost = require('completer.ghost')
local text = require('completer.text')

local M = {}
local S = core.S

--- The keys an accept mapping returns ('' when nothing is shown). A piece
--- within the line is inserted as if typed, with CTRL-R CTRL-R: Vim records
--- it for `.`, so the whole insert (typed and accepted text) repeats. One
--- that spans lines goes in through the API, exactly (typed, its line breaks
--- would be auto-indented on top of the indentation it carries), and `.`
--- then repeats only what was typed. CTRL-G u before and after: undo takes
--- back the accepted text alone, not what was typed before or after it.
function M.accept_keys(kind)
  local req = S.req
  if not core.visible() or not core.in_insert() then return '' end
  local snap = core.snapshot()
  if not core.follow(req, snap) then return '' end
  local rest = core.remaining(req)
  if rest == '' then return '' end
  local piece = kind == 'word' and text.next_word(rest) or kind == 'line' and text.next_line(rest) or rest
  req.consumed = req.consumed + #piece
  req.accepted = req.accepted + text.chars(piece)
  S.counts.accepted = S.counts.accepted + 1
  S.accepting = { req = req, kind = kind, piece = piece, snap = snap }
  local insert
  if piece:find('\n', 1, true) then
    insert = '<Cmd>lua require("completer.accept")._insert()<CR>'
  else
    insert = [[<C-r><C-r>=luaeval("require'completer.accept'._take()")<CR>]]
  end
  return '<C-g>u' .. insert .. '<Cmd>lua require("completer.accept")._accepted()<CR><C-g>u'
end

function M._take()
  return S.accepting and S.accepting.piece or ''
end

function M._insert()
  local a = S.accepting
  if a then text.insert(a.snap.buf, a.snap.row, a.snap.col, a.piece) end
end

-- After the piece is in: a whole accept ends the completion (and may ask
-- for the next line); a partial one shows the rest from the new cursor.
function M._accepted()
  local a = S.accepting
  S.accepting = nil
  if not a then return end
  local req, snap = a.req, core.snapshot()
  if S.req ~= req then return end
  if a.kind == 'all' or (req.done and core.remaining(req) == '') then
    S.req = nil
    ghost.clear()
    core.cancel(req)
    core.finish(req)
    if a.kind == 'all' and S.enabled and core.automatic() and core.allowed(snap.buf) and S.client:is_open() then
      -- The user just paused to accept: no debounce; ask for here at once
      -- (unless cached), then for the line Enter would open.
      local t = core.now()
      S.timer:stop()
      S.last_edit_key, S.pending_key = core.state_key(snap), nil
      if not core.serve(snap, t) then core.request_now(snap, t) end
      core.speculate(snap)
    end
    return
  end
  if a.piece:find('\n', 1, true) then -- a new line: follow from the cursor's new place
    req.origin, req.base = snap, req.consumed
  end
  if core.follow(req, snap) then core.render(req, snap) else core.dismiss() end
  S.last_edit_key = core.state_key(snap)
end

return M
