"""The shared merge of mixed prompt/decode graphs: each role commits into its own private frames, then the
merge copies the active frame, choosing per lane (slot) the role it is in, for both records and payload.

A mixed graph runs one prompt chunk (the prompt role: exactly the lane ``mixed_prompt_lane``) and decode
lanes (the decode role: every other active lane). ``role_buffers`` gives a role's commit the graph's
arguments with the shared bundle replaced by that role's private frames and the other role's lanes
inactive, so the ordinary commit (components/commit.py) writes the role's whole active frame: INVALID
records for lanes of the other role, and payload only for its own requesting lanes. ``merge_role_frames``
then writes only index ``frame_index`` of the shared outputs; the inactive frame (which the host may be
reading) is never rewritten, and the roles' frames are never read outside the active frame.
"""

from __future__ import annotations

import torch

from ignition.catalog.buffers import LOGPROBS, PROMPT_LANE, RECORDS, ROLE_FRAMES


def prompt_lanes(buffers: dict[str, torch.Tensor]) -> torch.Tensor:
    """bool [capacity]: the lane in the prompt role (none when ``mixed_prompt_lane`` is -1)."""
    lanes = torch.arange(buffers["active_lanes"].shape[0], device=buffers["active_lanes"].device)
    return lanes == buffers[PROMPT_LANE]


def role_buffers(buffers: dict[str, torch.Tensor], role: str, in_role: torch.Tensor) -> dict[str, torch.Tensor]:
    """The arguments a role's commit sees: its private frames as the bundle, lanes outside ``in_role`` inactive."""
    records, logprobs = ROLE_FRAMES[role]
    view = dict(buffers)
    view[RECORDS] = buffers[records]
    if LOGPROBS in buffers:
        view[LOGPROBS] = buffers[logprobs]
    view["active_lanes"] = torch.where(in_role, buffers["active_lanes"], 0)
    return view


def merge_role_frames(buffers: dict[str, torch.Tensor], in_prompt_role: torch.Tensor) -> None:
    """Copy the active frame of each lane's role into the shared outputs; nothing else is written."""
    frame = buffers["frame_index"]  # int64 [1]
    for index, shared in enumerate((RECORDS, LOGPROBS)):
        if shared not in buffers:
            continue
        prompt = buffers[ROLE_FRAMES["prompt"][index]].index_select(0, frame)  # [1, capacity, ...]
        decode = buffers[ROLE_FRAMES["decode"][index]].index_select(0, frame)
        chosen = in_prompt_role.view(1, -1, *([1] * (prompt.dim() - 2)))
        buffers[shared].index_put_((frame,), torch.where(chosen, prompt, decode))
