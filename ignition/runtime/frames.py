"""Frame readback and decoding, as the native worker does it.

A requesting frame copies only its own half of the packed output, and of each position
only the chosen pair and the first W pairs (W = max(K, largest selected-ID count in the
frame)) into preallocated host storage; a frame without a requesting lane copies no
payload. The pending frame keeps its physical-lane request mask, so stale payload of
other lanes is never decoded. Positions are chosen by record emission, never by payload.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ignition.catalog.abi import (PromptEntry, Record, TokenEntry, decode_packed_position, decode_prompt_row,
                                  decode_record)
from ignition.catalog.buffers import LOGPROBS, PROMPT_LOGPROBS, RECORDS
from ignition.catalog.contract import PACKED_CHOSEN_WORDS
from ignition.runtime.transfer import HostTransfer


@dataclass(slots=True)
class PendingFrame:
    """One submitted frame waiting to be decoded: its lanes' ownership and request mask."""

    frame: int
    lane_owner: list[tuple[int, int] | None]  # (slot, epoch) per lane, None for unused lanes
    request_mask: np.ndarray  # bool [capacity]: lanes that requested logprobs in this submission
    pairs: int  # W: pairs copied per position


class FrameReader:
    """Preallocated host storage (pinned on CUDA) for one variant's records, packed payload and prompt rows."""

    def __init__(self, buffers: dict[str, torch.Tensor], transfer: HostTransfer | None = None):
        self.transfer = transfer or HostTransfer(torch.device("cpu"))
        records = buffers[RECORDS]
        self.records_host = self.transfer.host_empty(records.shape[1:], records.dtype)  # [capacity, 16+T]
        payload = buffers.get(LOGPROBS)
        self.payload_host = None if payload is None else self.transfer.host_empty(payload.shape[1:], payload.dtype)
        prompt = buffers.get(PROMPT_LOGPROBS)
        self.prompt_host = None if prompt is None else self.transfer.host_empty(prompt.shape[1:], prompt.dtype)
        self.payload_copies = 0
        self.payload_words_copied = 0

    def read(self, buffers: dict[str, torch.Tensor], pending: PendingFrame, prompt_rows: int = 0) -> None:
        """Copy the pending frame's records, its payload only when a lane requested logprobs, and the
        first ``prompt_rows`` scored prompt rows; returns once the copies have landed."""
        self.transfer.begin()
        self.transfer.copy(self.records_host, buffers[RECORDS][pending.frame])
        if self.payload_host is not None and pending.request_mask.any():
            width = PACKED_CHOSEN_WORDS + 2 * pending.pairs
            source = buffers[LOGPROBS][pending.frame, :, :, :width]
            self.transfer.copy(self.payload_host[:, :, :width], source)
            self.payload_copies += 1
            self.payload_words_copied += source.numel()
        if prompt_rows:
            self.transfer.copy(self.prompt_host[:prompt_rows], buffers[PROMPT_LOGPROBS][pending.frame, :prompt_rows])
        self.transfer.finish()

    def record(self, lane: int) -> Record:
        return decode_record(self.records_host[lane].numpy())

    def entry(self, lane: int, position: int, pending: PendingFrame, token: int, natural: int | None,
              selected: int) -> TokenEntry:
        """Decode one position's payload; raise ValueError if it is missing or disagrees with the record."""
        if not pending.request_mask[lane] or self.payload_host is None:
            raise ValueError(f"missing logprob payload for lane {lane} position {position}")
        words = self.payload_host[lane, position].numpy()
        packed = decode_packed_position(words[:PACKED_CHOSEN_WORDS + 2 * pending.pairs], pending.pairs)
        if packed.chosen_id != token:
            raise ValueError(f"logprob payload chosen id {packed.chosen_id} does not match emitted token {token} "
                             f"(lane {lane}, position {position})")
        if np.isnan(packed.chosen_logprob):
            raise ValueError(f"logprob payload for token {token} holds NaN (lane {lane}, position {position})")
        count = selected if selected else (natural or 0)
        top = list(packed.alternatives[:count])
        if selected and len(top) != selected:
            raise ValueError(f"logprob payload lists {len(top)} of {selected} selected ids (lane {lane})")
        return TokenEntry(token, packed.chosen_logprob, top)

    def prompt_entry(self, row: int, alternatives: int) -> PromptEntry:
        """Decode scored prompt row ``row`` of the last read (its first ``alternatives`` pairs)."""
        return decode_prompt_row(self.prompt_host[row].numpy(), alternatives)
