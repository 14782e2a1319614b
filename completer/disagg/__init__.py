"""Conditional disaggregation: long uncached prompts prefilled by a separate
worker process (here or on another host), their K/V shipped into blocks the
decode engine reserved. `decision` (local or remote), `messages` (the control
channel's frames), `transport` (framing and the torch.distributed pair that
carries K/V), `worker` (`completer prefill-worker`), `remote` (the decode
engine's side: links, jobs, ownership of the blocks being written).
"""
